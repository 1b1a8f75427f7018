"""`ggwgpu bench ranks`: how data-parallel training over MPI scales with the number of
processes, and what share of a step the gradient allreduce takes. Registered on the bench
group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations


import json
import os
import shutil
import subprocess
import sys

import click

from ggwgpu.bench import measure_ranks

from .bench import config_option, json_option, write_json
from .common import describe_backend, positive_ints, select_backend
from .training import mpi_world


def measure(ctx, config_name: str, steps: int) -> dict:
    """measure_ranks of this process's share of the run, the backend named."""
    world = mpi_world()
    backend = select_backend(ctx)
    row = measure_ranks(config_name, backend, world, steps)
    return {"ranks": row["ranks"], "backend": describe_backend(backend), **row}


def run_with(ranks: int, mpiexec: str, ctx, config_name: str, steps: int) -> dict:
    """measure() in `ranks` fresh processes (mpiexec; one process without it)."""
    argv = [sys.executable, "-m", "ggwgpu_cli.main"]
    if ctx.obj and ctx.obj.get("backend"):
        argv += ["--backend", ctx.obj["backend"]]
    argv += ["bench", "ranks", "--worker", "--config", config_name, "--steps", str(steps)]
    if ranks > 1:
        argv = [mpiexec, "-n", str(ranks), *argv]
    r = subprocess.run(argv, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        raise click.ClickException(f"{' '.join(argv)} failed (exit {r.returncode}):\n"
                                   f"{(r.stderr or r.stdout)[-2000:]}")
    return json.loads(lines[-1])


def default_mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or "mpiexec"


@click.command("ranks")
@config_option
@click.option("--ranks", "counts", default="1,2", show_default=True,
              callback=positive_ints("1,2,4"),
              help="Process counts to compare, each run in fresh processes.")
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed steps per run, after one warm-up step.")
@click.option("--mpiexec", default=default_mpiexec, show_default="mpiexec next to python, "
              "else on PATH", help="The MPI launcher.")
@click.option("--worker", is_flag=True, hidden=True)
@json_option
@click.pass_context
def bench_ranks(ctx, config_name, counts, steps, mpiexec, worker, json_path):
    """Data-parallel training tokens/s with 1, 2, ... processes (each training the config's
    batch, on random tokens) and the time of the gradient allreduce per step: within the
    steps (waiting for the slowest rank included) and alone (all ranks there at once).

    Every count runs in fresh processes started by mpiexec (needs mpi4py and an MPI: pip
    install 'ggwgpu[mpi]' mpich); under mpirun itself this measures that run only.
    Processes that share a machine's cores (or one GPU) compete for them: there the scaling
    says what the allreduce costs, not what more machines would gain.
    """
    world = mpi_world()
    if worker or world is not None:
        row = measure(ctx, config_name, steps)
        if world is None or world.is_root:
            click.echo(json.dumps(row) if worker else format_row(row, row))
        return
    rows = [run_with(n, mpiexec, ctx, config_name, steps) for n in counts]
    click.echo(f"bench ranks {config_name} on {rows[0]['backend']}: each process trains "
               f"{rows[0]['tokens_per_step']} tokens per step; {steps} timed steps")
    click.echo(f"{'ranks':>5} {'tokens/s':>10} {'ms/step':>9} {'allreduce ms':>13} "
               f"{'share':>6} {'scaling':>8} {'alone ms':>9}")
    for row in rows:
        click.echo(format_row(row, rows[0]))
    write_json(json_path, {"bench": "ranks", "config": config_name, "steps": steps,
                           "runs": rows})


def format_row(row: dict, first: dict) -> str:
    """One table line; scaling: tokens/s against `first`'s per process."""
    scaling = row["tokens_per_s"] / (first["tokens_per_s"] / first["ranks"] * row["ranks"])
    return (f"{row['ranks']:>5} {row['tokens_per_s']:>10.0f} "
            f"{1e3 * row['seconds_per_step']:>9.1f} "
            f"{1e3 * row['allreduce_seconds_per_step']:>13.2f} "
            f"{row['allreduce_share']:>6.1%} {scaling:>8.2f} "
            f"{1e3 * row['allreduce_alone_seconds']:>9.2f}")
