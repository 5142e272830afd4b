"""What a forked child of memlab does first.

The estimate's suggestions and the planner's look-ahead trace in a child made by ``fork`` (it starts with the
parent's imports and warm state). A thread pool does not survive ``fork``: when the parent has run an op on
torch's intra-op pool (OpenMP, libgomp on Linux builds), the child's next parallel region waits for threads
that no longer exist and never returns (measured on this course's CPU machine: a 2000 x 2000 matmul and an
``exp`` over 10**7 values after fork hung; with one thread set first, 0.24 s). PyTorch's DataLoader workers
set one thread for the same reason. The child here traces on fake tensors, where one thread costs nothing.
"""

from __future__ import annotations

import sys


def single_threaded_child() -> None:
    """Call first in a forked child: torch's intra-op pool down to one thread (no parallel region waits for
    threads the fork left behind). Without torch imported, nothing to do."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
