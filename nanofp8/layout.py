"""
Where this process stands in the run: the layout object, built once, present in every run.

A training run is N processes arranged as a pp x dp x tp grid (row-major, tp fastest):

    global rank = (pp_rank * dp + dp_rank) * tp + tp_rank

tensor-parallel ranks are neighbours, which puts the chattiest collectives (a partial sum per
Linear) on the fastest links (NVLink inside a node); data-parallel replicas come next; pipeline
stages, which only hand activations to their neighbour, are the outermost dimension. torch's
DeviceMesh builds exactly this grid and one process group per dimension:

    init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))

One process (python train.py ...) gets the same object with every size 1, every rank 0 and no
process groups: code that sums over the data-parallel replicas asks `layout.dp > 1`, never
"is this distributed?", and train.py does not ask at all.

nanofp8/parallel.py reads the fields of this object (its ParallelGroups is this class): the sizes
and ranks, the three groups, pp_ranks (the global ranks of this rank's pipeline, stage by stage,
for send/recv) and embed_group ({first stage, last stage}: the two copies of a tied embedding).

Faults under torchrun: a rank that hangs (deadlocked, stopped, swapping, lost its GPU) leaves the
others waiting inside a collective. Every group gets a timeout (dist_timeout) after which the
waiting collective raises, and a second, gloo-only group is kept aside to find out who is
missing: a monitored_barrier on it reports the ranks that do not answer (a fresh group, because
the one whose collective timed out may be left half-way through a message). A rank whose process
died (killed, out of memory) breaks the collective at once, not after the timeout: every rank
leaves its host and pid in torchrun's store when the group forms, so the others name a dead peer
as dead. With NCCL, torch's watchdog may abort the process at the same timeout with its own
message instead.
"""

import atexit
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .configurator import ConfigError


@dataclass(frozen=True)
class Layout:
    """This rank's place in the pp x dp x tp grid, its groups, and its device."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    pp_ranks: tuple = (0,)  # global ranks of this rank's pipeline, stage by stage
    embed_group: object = None  # {first stage, last stage} of this pipeline (tied embeddings)
    rank: int = 0
    world: int = 1
    device: str = "cpu"
    engine: str = "nanofp8"  # "nanofp8" (the hand-written engine) | "torch" (nanofp8/torchstack.py)
    mesh: object = None  # torch's DeviceMesh of the grid, (pp, dp, tp), under torchrun
    replicate: int = 1  # engine=torch: the dp ranks as replicate x (dp / replicate) shards (HSDP)
    hsdp_mesh: object = None  # engine=torch, replicate > 1: this rank's dp ranks, ("replicate", "shard")

    @property
    def model_parallel(self):
        """The model is cut over tp * pp ranks (nanofp8/parallel.py's layers and stages)."""
        return self.tp * self.pp > 1

    @property
    def master(self):
        """Rank 0: logs, prepares the dataset, keeps the FP8 statistics."""
        return self.rank == 0

    @property
    def writer(self):
        """Writes a checkpoint file: data-parallel rank 0 of every (tensor, pipeline) position."""
        return self.dp_rank == 0

    @property
    def device_type(self):
        return self.device.split(":")[0]

    @property
    def dropout_stream(self):
        """What seeds this rank's dropout RNG. Each rank draws its own masks, except that a
        tensor-parallel group shares one stream: its replicated activations must drop the same
        units. (The plain data-parallel key is the rank, as it always was: same masks as before.)"""
        return (self.dp_rank, self.pp_rank) if self.model_parallel else self.rank

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def micro_batch_keys(self, accum):
        """(index, rank) for batch_generator of this rank's `accum` micro-batches. Model parallel:
        micro-batch m of replica d is what one process draws at micro-step d * accum + m, so an
        iteration sees the same tokens at any layout and its loss compares with one device's.
        Data parallel: each rank draws its own stream (the seeding of every run so far)."""
        if self.model_parallel:
            return [(self.dp_rank * accum + m, 0) for m in range(accum)]
        return [(m, self.rank) for m in range(accum)]

    def describe(self, sp=False):
        shard = self.dp // self.replicate
        hsdp = f" (HSDP: {self.replicate} replicas, each sharded over {shard} rank{'s' * (shard > 1)})" \
            if self.replicate > 1 else ""
        if not self.model_parallel:
            return f"{self.world} process{'es' if self.world > 1 else ''}{hsdp}"
        return (f"{self.dp} data{hsdp} x {self.tp} tensor{' (+sequence)' if sp else ''} x {self.pp} "
                f"pipeline parallel")


def make_layout(tp=1, pp=1, device=None, engine="nanofp8", replicate=1):
    """The layout of an initialized process group, arranged as pp x dp x tp by DeviceMesh. Every
    rank must call it (creating a group is a collective, in the same order everywhere).

    replicate > 1 (engine=torch's HSDP) splits the dp dimension once more, as replicate x shard
    (dp rank = replica * shard + shard rank, the same order): FSDP2 shards each parameter over a
    replica's `shard` ranks and all-reduces gradients across the replicas. A second DeviceMesh,
    (pp, replicate, shard, tp), gives those two dimensions their groups; the dp group stays the
    first mesh's, which sums the loss and keeps the batches of every data-parallel rank apart."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    dp = world // (tp * pp)
    if dp % replicate:
        raise ValueError(f"{dp} data-parallel ranks cannot form {replicate} replicas of equal size")
    device = device or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    mesh = init_device_mesh(device.split(":")[0], (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    hsdp = None
    if replicate > 1:
        hsdp = init_device_mesh(device.split(":")[0], (pp, replicate, dp // replicate, tp),
                                mesh_dim_names=("pp", "replicate", "shard", "tp"))["replicate", "shard"]
    coord = mesh.get_coordinate()  # (pp_rank, dp_rank, tp_rank)
    pp_ranks = tuple(mesh["pp"].mesh.tolist())
    embed = None
    if pp > 1:  # not a mesh dimension: the two ends of each pipeline, created by every rank
        for ends in mesh.mesh[[0, -1]].permute(1, 2, 0).reshape(-1, 2).tolist():
            group = dist.new_group(ends)
            if me in ends:
                embed = group
    return Layout(dp=dp, tp=tp, pp=pp, dp_rank=coord[1], tp_rank=coord[2], pp_rank=coord[0],
                  dp_group=mesh.get_group("dp"), tp_group=mesh.get_group("tp"),
                  pp_group=mesh.get_group("pp"), pp_ranks=pp_ranks, embed_group=embed,
                  rank=me, world=world, device=device, engine=engine, mesh=mesh, replicate=replicate,
                  hsdp_mesh=hsdp)


def check_layout(cfg, launched, world):
    """The layout settings that need the number of processes: ConfigError, naming the keys."""
    tp, pp = cfg["tensor_parallel"], cfg["pipeline_parallel"]
    if tp * pp > 1 and not launched:
        raise ConfigError(f"tensor_parallel={tp}, pipeline_parallel={pp} split the model over "
                          f"processes: launch with torchrun --nproc_per_node=N, N a multiple of {tp * pp}")
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by tensor_parallel * "
                          f"pipeline_parallel = {tp} * {pp}")
    dp, replicate = world // (tp * pp), cfg["data_parallel_replicate"]
    if dp % replicate:
        raise ConfigError(f"data_parallel_replicate={replicate} must divide the {dp} data-parallel ranks (world size "
                          f"{world} / tensor_parallel {tp}): each replica shards over the same number of ranks")
    if cfg["precision"] == "O3" and not launched:
        raise ConfigError("precision=O3 shards the optimizer state over data-parallel ranks: launch "
                          "it with torchrun (torchrun --nproc_per_node=N train.py ..., N >= 1)")


def start(cfg, check=lambda dp_size: None):
    """The layout of this run: one process, or torchrun's (process groups started here, with
    cfg's dist_timeout); CUDA devices also run fp32 matmuls outside autocast in TF32. `check(dp_size)` runs before any process group exists, so that a
    ConfigError stops every rank alike instead of leaving the others waiting."""
    launched = int(os.environ.get("RANK", -1)) != -1
    device = cfg["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    check_layout(cfg, launched, world)
    check(world // (cfg["tensor_parallel"] * cfg["pipeline_parallel"]))
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast: use TF32
        torch.backends.cudnn.allow_tf32 = True
    if not launched:
        return Layout(device=device, engine=cfg["engine"])
    if device.startswith("cuda"):
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    try:
        init_distributed(cfg["dist_timeout"], "nccl" if device.startswith("cuda") else "gloo")
    except (RuntimeError, ValueError) as e:  # torch's DistStoreError, a port in use, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise GroupError(f"the process group did not form within dist_timeout={cfg['dist_timeout']:g}s "
                         f"({type(e).__name__}: {first}): a rank stopped or failed before joining; see "
                         f"its own error") from None
    check_same_config(cfg)
    return make_layout(cfg["tensor_parallel"], cfg["pipeline_parallel"], device, cfg["engine"],
                       cfg["data_parallel_replicate"])


class GroupError(RuntimeError):
    """The processes of a torchrun job did not come together (the command exits with status 3)."""


def check_same_config(cfg):
    """Every rank must run the same settings: a difference (a config file that reads the
    environment, different files on different nodes) builds different models, whose collectives
    then wait for each other until dist_timeout. ConfigError on every rank, naming the first key."""
    mine = {k: repr(v) for k, v in cfg.items()}
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    for rank, theirs in enumerate(got):
        diff = [k for k in mine if theirs.get(k) != got[0].get(k)]
        if diff:
            k = diff[0]
            raise ConfigError(f"the ranks were started with different settings: rank {rank} has {k}={theirs[k]}, "
                              f"rank 0 {k}={got[0][k]}" + (f" (and {len(diff) - 1} more keys)" if len(diff) > 1 else "")
                              + ": give every rank the same command line and config files")


def stop(layout):
    """The end of a run that went well: the ranks meet once more, then tear down together, so no
    rank closes its connections while another is still in its last collective (rank 0 writes the
    last log lines and releases the lock after the others are done). The process then ends
    through leave_process."""
    if dist.is_initialized():
        dist.barrier(group=_monitor_group)  # (gloo, on every backend: no device needed)
        dist.destroy_process_group()


def leave_process(code=0):
    """End a process that ran gloo collectives, once Python's exit handlers have run: at
    interpreter exit, the C++ teardown of torch.distributed's threads aborted a finished process
    about once in a hundred to two hundred ("terminate called without an active exception",
    SIGABRT after the process's last Python line; seen in torchrun ranks and spawned ones)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -----------------------------------------------------------------------------
# A collective that never completes

_monitor_group, _dist_timeout = None, None


def init_distributed(timeout_s, backend):
    global _monitor_group, _dist_timeout
    _dist_timeout = timeout_s
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout)
    _monitor_group = dist.new_group(backend="gloo", timeout=timeout)
    _store().set(f"nanofp8/process/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")


def _store():
    """The process group's key-value store: torchrun's agent holds it, so it outlives a dead rank."""
    return dist.distributed_c10d._get_default_store()


def _process_gone(pid):
    """Whether a process of this machine has exited (a zombie not yet reaped by torchrun counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def dead_ranks(wait_s=2.0):
    """The ranks on this machine whose process has exited (those on other machines cannot be
    checked from here), waiting up to wait_s for a dying one to go."""
    try:
        store = _store()
        store.set_timeout(timedelta(seconds=5))
        procs = {r: store.get(f"nanofp8/process/{r}").decode().split() for r in range(dist.get_world_size())}
    except Exception:  # no store any more (a rank's own, gone with it): nothing to tell
        return []
    mine = [(r, int(pid)) for r, (host, pid) in procs.items() if host == socket.gethostname() and r != dist.get_rank()]
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r, pid in mine if _process_gone(pid)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.1)


def is_collective_failure(error):
    """A collective that timed out or lost its peer. gloo raises a plain RuntimeError from inside
    DDP's backward or from `work.wait()` ("Timed out waiting ...", "Application timeout caused
    pair closure", "Connection reset by peer"), a DistError elsewhere."""
    signs = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe", "pair closure")
    return dist.is_initialized() and (
        isinstance(error, dist.DistError) or any(s in str(error).lower() for s in signs))


def report_collective_failure(error, doing="", last_good=""):
    """Called when a collective failed: name a dead peer as dead (dead_ranks), else the ranks that
    do not answer (rank 0 finds out, with a short monitored barrier); print one line, with what
    this rank was doing (`doing`: "saving ckpt-00000004", or "") and the checkpoint to resume from
    (`last_good`), and leave without waiting on anyone."""
    rank = dist.get_rank()
    during = f" while {doing}" if doing else ""
    then = f"; {last_good}: resume from it with init_from=resume" if last_good else ""
    dead = dead_ranks()
    if dead:
        ranks = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}"
        _leave(f"error: rank {rank}: {ranks} died (the process exited){during}, so the run stopped{then}")
    who = "rank 0 names the ranks that do not answer"
    try:
        dist.monitored_barrier(_monitor_group, timeout=timedelta(seconds=min(10.0, _dist_timeout)),
                               wait_all_ranks=True)
        who = "all ranks answer now"
    except Exception as e:  # rank 0: "Ranks 1, 3 failed to pass monitoredBarrier in 10000 ms"
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
        if found:
            ranks = found.group(1).strip()
            who = f"rank{'s' if ',' in ranks else ''} {ranks} not answering: stopped, hung or dead"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0].split("] ")[-1][:160]
    lost = any(s in first.lower() for s in ("connection reset", "connection closed", "broken pipe"))
    what = "lost its connection to a rank" if lost else f"did not complete within dist_timeout={_dist_timeout:g}s"
    _leave(f"error: rank {rank}: a collective {what}{during}; {who} ({first}){then}")


def _leave(line):
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(3)  # not sys.exit: tearing the process group down would wait for the missing ranks
