"""`ggwgpu plot LOG`: the loss curve of a train or finetune --log as a PNG (matplotlib).
Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import math

import click

from .outputs import check_outputs
from .common import InputPath

# a preference finetune's metrics (training/preference.py), per step and on validation
PREFERENCE = ("accuracy", "margin", "val_accuracy", "val_margin")


def draw_preference(ax, records):
    """Accuracy (share of pairs whose chosen answer's reward is higher) on the left axis,
    the mean reward margin on the right, per step and at each validation."""
    for key, style in (("accuracy", "-"), ("val_accuracy", "o-")):
        drawn = [r for r in records if key in r]
        if drawn:
            ax.plot([r["step"] for r in drawn], [r[key] for r in drawn], style,
                    label=key.replace("_", " "))
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("preference accuracy")
    ax.legend(loc="lower left")
    margin_ax = ax.twinx()
    for key, style in (("margin", "-"), ("val_margin", "o--")):
        drawn = [r for r in records if key in r]
        if drawn:
            margin_ax.plot([r["step"] for r in drawn], [r[key] for r in drawn], style,
                           color="gray", linewidth=0.8, label=key.replace("_", " "))
    margin_ax.set_ylabel("reward margin")
    margin_ax.legend(loc="lower right")


@click.command()
@click.argument("log", type=InputPath(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="The PNG to write. Default: the log's name with .png.")
def plot(log, out):
    """Plot the loss (validation loss too, and the learning rate) of a `train --log` or
    `finetune --log` JSONL file as a PNG; for a preference finetune (--objective dpo, ipo,
    orpo, cpo, simpo) also the accuracy and margin of its pairs, below.

    Needs matplotlib: pip install 'ggwgpu[plot]'.
    """
    import json
    from pathlib import Path
    from ggwgpu.files import read_limited
    out = out or str(Path(log).with_suffix(".png"))
    check_outputs([("LOG", log)], [("--out", out)])
    try:
        text = read_limited(log, click.ClickException).decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{log}: not valid UTF-8 at byte offset {e.start}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError) as e:
            raise click.ClickException(f"{log}, line {number}: not JSON ({e})") from None

    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    if not all(isinstance(r, dict) and number(r.get("step")) for r in records):
        raise click.ClickException(f"{log} has no training records (a step number on every "
                                   f"line)")
    # a step whose loss was not finite has none (null): it is not drawn
    records = [r for r in records if number(r.get("loss"))]
    if not records:
        raise click.ClickException(f"{log} has no training records with a finite loss")
    records = [r if number(r.get("val_loss", 0)) and number(r.get("lr", 0))
               else {"step": r["step"], "loss": r["loss"]} for r in records]
    for r in records:           # a preference finetune's metrics, where finite
        for key in PREFERENCE:
            if key in r and not number(r[key]):
                del r[key]
    for key in ("step", "loss", "val_loss", "lr", *PREFERENCE):   # axes need a finite span
        values = [r[key] for r in records if key in r]
        if values and not math.isfinite(max(values) - min(values)):
            raise click.ClickException(f"{log}: the {key} values span {min(values):g} to "
                                       f"{max(values):g}, too wide to draw")
    try:          # after the log is checked: a bad log is refused without it
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("plot needs matplotlib: pip install 'ggwgpu[plot]'") from None
    out = out or str(Path(log).with_suffix(".png"))
    preference = any("accuracy" in r for r in records)
    fig, axes = plt.subplots(2 if preference else 1, 1, figsize=(8, 7 if preference else 4.5),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="loss")
    validated = [r for r in records if "val_loss" in r]
    if validated:           # finetune --val-every
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], "o-",
                label="validation loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if all("lr" in r for r in records):
        lr_ax = ax.twinx()
        lr_ax.plot([r["step"] for r in records], [r["lr"] for r in records], color="gray",
                   linewidth=0.8, label="learning rate")
        lr_ax.set_ylabel("learning rate")
    ax.set_title(Path(log).name)
    if preference:
        draw_preference(axes[1][0], records)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:                    # a missing directory, a full disk
        raise click.ClickException(f"{out}: not written ({e.strerror or e})") from None
    click.echo(f"wrote {out}")
