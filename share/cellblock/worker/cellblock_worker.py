"""cellblock worker: runs IPython inside the sandbox and talks to cellblock-kernel over fd 3.

Started by the kernel as `/usr/bin/python3 cellblock_worker.py` with fd 0 = /dev/null, fds 1/2 = pipes
the kernel reads, fd 3 = the channel socket. See PROTOCOL.md.
"""

import os
import sys

if __name__ == "__main__":
    worker_dir = os.path.dirname(os.path.realpath(__file__))
    if sys.path[0] != worker_dir:
        sys.path.insert(0, worker_dir)
    from cellblock_runtime.main import main

    sys.exit(main(worker_dir))
