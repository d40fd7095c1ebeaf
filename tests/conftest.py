"""What every test file shares: the header that says which machine ran the suite, and the one
way to run a function on several gloo ranks.

Why a shared launcher (tests/test_zero.py aborted about one run in three on some machines, rank 0
dying with "terminate called without an active exception"): with `MASTER_ADDR`/`MASTER_PORT`
(env://) rendezvous, rank 0 itself hosts the TCPStore server, and since torch 2.4 that server is
the libuv daemon. Its destructor joins the daemon thread only if the loop still runs
(`LibUVStoreDaemon::~LibUVStoreDaemon`: `if (!is_running()) {...} else { dispose(); }`), so a
teardown that finds the loop already stopped destroys a joinable std::thread, and C++ calls
std::terminate. Whether it does depends on thread timing at exit: hence "one run in three", and
only on rank 0, the one process that hosts the server. `spawn` below rendezvous through a file
(a FileStore: no server, no thread to outlive), runs every rank with one intra-op thread (N ranks
share 2 cores), and always destroys the process group, also when the test body fails.
(torchrun is not affected the same way: its agent hosts the store, not rank 0.)
"""

import os

# No GPU in the test suite: every Triton kernel that runs in this process runs in the interpreter.
# Set before anything imports triton (torch.compile imports it too), so that triton's own
# functions are built for the interpreter in every test file, whatever order they run in.
# (tests/test_sm90_compile.py compiles for sm_90 in child processes started without it.)
os.environ.setdefault("TRITON_INTERPRET", "1")

import platform  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def pytest_report_header(config):
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        cpu = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    import numpy
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    return (f"nanofp8: CPU {cpu} ({os.cpu_count()} cores), torch {torch.__version__} "
            f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), triton {tv}, "
            f"numpy {numpy.__version__}")


def _rank_main(rank, fn, world, store, timeout_s, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
        dist.barrier()  # nobody tears down while another rank may still talk to it
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args, timeout_s=120, deadline_s=600):
    """Run fn(rank, world, *args) on `world` gloo ranks in fresh processes and wait for all of
    them; an exception or a crash on any rank fails the caller. Collectives time out after
    timeout_s, so a rank stuck in one fails instead of hanging; and whatever happens, the ranks
    are killed and the test fails after deadline_s (a rank stuck outside a collective, or ranks
    that issue different collectives)."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_rank_main, args=(fn, world, os.path.join(d, "store"), timeout_s, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + deadline_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{world} ranks of {fn.__name__} did not finish within {deadline_s} s")
