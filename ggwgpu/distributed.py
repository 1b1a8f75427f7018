"""Data-parallel training across processes with MPI (mpi4py, an optional extra).

Under `mpirun -n N` (or mpiexec, srun) every process, a rank, builds the same graph with
batch / N rows and takes its own rows of every global batch: the sample order is the
single-process one, cut into N parts. The target weights of each rank's loss are
1 / (the counted targets of the whole global batch), so each rank's loss and gradients are
its share of the global mean, and their sum over the ranks is the mean of one process with
the whole batch. Between the backward and the optimizer the gradients of a step travel as
one flat buffer: one readback, one MPI allreduce (a sum), one upload; clipping, the
non-finite gate and the optimizer then run on the same numbers on every rank, so the weights
stay identical.

The MPI world is recognised by the launcher's environment variables, so nothing needs a
flag, and mpi4py is imported only then.
"""
from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

from . import ops as O
from .tensor import contiguous_strides, constant, input_tensor

# The world's size and this process's rank on its machine, as the launchers set them:
# Open MPI, MPICH and Intel MPI (Hydra), MVAPICH, Slurm.
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                   "SLURM_LOCALID")
ABORT_GRACE_SECONDS = 1.0   # World.abort: time for a message to reach the launcher
INSTALL_HINT = ("pip install 'ggwgpu[mpi]' (mpi4py) with an MPI library: the system's "
                "(Debian: openmpi-bin or mpich) or a wheel (pip install mpich)")


class DistributedError(RuntimeError):
    """The MPI world cannot be used as asked; the message says why and what to do."""


def launcher_int(names, least: int) -> int:
    """The first of the launcher's variables `names` that holds an integer, at least `least`;
    `least` without one."""
    for var in names:
        try:
            return max(least, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return least


def launched_size() -> int:
    """How many processes the MPI launcher started (1 without one)."""
    return launcher_int(SIZE_VARS, 1)


def local_rank() -> int:
    """This process's rank among those of the launcher on this machine (0 without one): which
    of the machine's GPUs it takes."""
    return launcher_int(LOCAL_RANK_VARS, 0)


class World:
    """The processes of one data-parallel run: this one's rank, their number, and the two
    collective operations training needs."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.allreduce_seconds = 0.0     # spent in allreduce so far (bench reports it)

    @property
    def is_root(self) -> bool:
        """Rank 0 alone writes logs, checkpoints and the trained model."""
        return self.rank == 0

    def allreduce(self, buffer: np.ndarray) -> np.ndarray:
        """Sum `buffer` (contiguous) over the ranks, in place. Every rank gets the same bits:
        MPI's allreduce algorithms either add each pair on both of its ranks (a + b and
        b + a are equal in IEEE arithmetic) or add once and send the sum on; the tests check
        the weights after every step."""
        from mpi4py import MPI
        start = time.perf_counter()
        self.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        self.allreduce_seconds += time.perf_counter() - start
        return buffer

    def local_batch(self, batch: int) -> int:
        """This rank's rows of a global batch of `batch` samples."""
        if batch % self.size:
            raise DistributedError(f"a batch of {batch} samples does not split evenly over "
                                   f"{self.size} processes: make it a multiple of {self.size}")
        return batch // self.size

    def rows(self, inputs, targets) -> tuple[np.ndarray, np.ndarray, int]:
        """This rank's rows of a global batch (inputs, targets), and the counted targets (>= 0)
        of the whole batch, which every rank's loss is divided by."""
        n = self.local_batch(len(inputs))
        mine = slice(self.rank * n, (self.rank + 1) * n)
        return inputs[mine], targets[mine], int((np.asarray(targets) >= 0).sum())

    def abort(self, message: str, code: int = 1):
        """End every rank of the job (MPI_Abort) after saying why on the process's stderr
        (the real one: ranks other than 0 have theirs silenced)."""
        print(f"rank {self.rank} of {self.size}: {message}; ending all {self.size} processes",
              file=sys.__stderr__, flush=True)
        # the launcher forwards a rank's output through its own processes, and the abort
        # stops them: output still in flight was lost under load (MPICH's hydra), so wait
        # for it to pass first
        time.sleep(ABORT_GRACE_SECONDS)
        self.comm.Abort(code)


@functools.cache
def world() -> World | None:
    """The MPI world when a launcher started more than one process, else None. Raises
    DistributedError when mpi4py (or an MPI library) is missing."""
    size = launched_size()
    if size == 1:
        return None
    try:
        from mpi4py import MPI
    except ImportError as e:  # also when mpi4py finds no MPI library to load
        raise DistributedError(f"started by an MPI launcher with {size} processes, but mpi4py "
                               f"cannot be imported ({e}): {INSTALL_HINT}") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != size:
        raise DistributedError(f"the launcher says {size} processes, MPI's world has "
                               f"{comm.Get_size()}: is mpi4py built for another MPI than the "
                               f"mpirun used?")
    return World(comm)


def on_every_rank(exc: BaseException) -> BaseException:
    """Mark an exception that every rank raises at the same point (an agreed stop, a
    non-finite step): the ranks then end by themselves instead of aborting the job."""
    exc.on_every_rank = True
    return exc


class RankGuard:
    """Around a command under MPI: an exception on one rank (a failing device, a checkpoint
    that cannot be written) ends the whole job with MPI_Abort and its message; the others
    would otherwise wait in the next allreduce for ever. Exceptions marked on_every_rank
    and clean exits pass through."""

    def __init__(self, world: World | None, describe=lambda e: f"{type(e).__name__}: {e}"):
        self.world, self.describe = world, describe

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if self.world is None or exc is None or getattr(exc, "on_every_rank", False):
            return False
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return False
        self.world.abort(self.describe(exc) or type(exc).__name__)
        return False


class GradientExchange:
    """The graph side of the gradient allreduce: the step's gradients are copied into one
    flat buffer (`sent`, read back once), and the optimizer reads the summed ones from one
    flat input (`received`, written once), together with the summed loss for the
    non-finite gate. The host buffer carries two more numbers: the ranks asking to stop
    (a signal) and their signal numbers, so every rank stops after the same step."""

    def __init__(self, grads: dict):
        sizes = [p.nelements for p in grads]
        self.n = sum(sizes)
        self.sent = constant(np.zeros(self.n, np.float32), name="gradients to send")
        self.received = input_tensor((self.n + 1,), name="summed gradients and loss")
        self.copies, self.grads, at = [], {}, 0
        for (p, grad), size in zip(grads.items(), sizes):
            strides = contiguous_strides(p.shape)
            self.copies.append(O.cpy(grad, O.view(self.sent, p.shape, strides, at)))
            self.grads[p] = O.view(self.received, p.shape, strides, at)
            at += size
        self.loss = O.view(self.received, (1,), (1,), self.n)
        self.buffer = None

    def exchange(self, world: World, plan, sent: np.ndarray, loss: float,
                 stop: int) -> tuple[float, int]:
        """Sum this rank's gradients (`sent`'s value, read back) and `loss` over the ranks
        into `received`; returns the summed loss and the agreed stop signal (0: go on)."""
        if self.buffer is None or self.buffer.dtype != sent.dtype:  # float64 on numpy-f64
            self.buffer = np.zeros(self.n + 3, sent.dtype)
        buf = self.buffer
        buf[:self.n] = sent
        buf[self.n:] = loss, float(stop > 0), float(stop)
        world.allreduce(buf)
        plan.write(self.received, buf[:self.n + 1])
        stops = int(buf[self.n + 1])
        return float(buf[self.n]), round(float(buf[self.n + 2]) / stops) if stops else 0
