"""The quantizer block: the DualAxisConfig a plan's codecs run and its statistics' distortion was measured
with, as JSON (plan.json "quantizer", stats.safetensors settings "quantizer").

A plan pins its quantizer so it keeps quantizing the same way when the library's defaults change, and
the allocation's d_u(b) table must come from the same quantizer. Files written before the block existed
(plan format version 1 without it, statistics with only a "dual_axis_config" repr) were made with
:data:`V1_QUANTIZER`, the library defaults until then.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from stepquant.codecs.base import Grid
from stepquant.codecs.dual_axis import DualAxisConfig

V1_QUANTIZER = DualAxisConfig(grid=Grid.MIDRISE, row_stat="rms", clip=(0.6, 0.85, 0.95, 1.0, 1.0, 1.0, 1.0),
                              refit_iters=2, step_normalised_refit=True, division="exact")


def quantizer_to_json(config: DualAxisConfig) -> dict:
    """The quantizer block of a DualAxisConfig ("row_fill" only when on: a plan without it reads, and an
    older stepquant refuses a plan with it instead of quantizing it another way)."""
    block = {"grid": config.grid.value, "row_stat": config.row_stat, "clip": list(config.clip),
             "refit_iters": config.refit_iters, "step_normalised_refit": config.step_normalised_refit,
             "division": config.division}
    return block | ({"row_fill": True} if config.row_fill else {})


def quantizer_from_json(block, where: Path | str = "plan.json") -> DualAxisConfig:
    """The DualAxisConfig of a quantizer block; :data:`V1_QUANTIZER` for None (a file written without one).

    Blocks written before "division" existed divided exactly (V1_QUANTIZER's value), and those written
    before "row_fill" existed did not fill their rows.
    """
    if block is None:
        return V1_QUANTIZER
    fields = set(quantizer_to_json(V1_QUANTIZER)) | {"row_fill"}
    if isinstance(block, Mapping):
        block = {"division": V1_QUANTIZER.division, "row_fill": V1_QUANTIZER.row_fill, **block}
    if not isinstance(block, Mapping) or set(block) != fields:
        raise ValueError(f"{where}: the quantizer block must have the fields "
                         f"{sorted(fields)}, got {block!r}; recalibrate")
    try:
        return DualAxisConfig(grid=block["grid"], row_stat=block["row_stat"], clip=tuple(block["clip"]),
                              refit_iters=block["refit_iters"],
                              step_normalised_refit=block["step_normalised_refit"],
                              division=block["division"], row_fill=block["row_fill"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: invalid quantizer block ({err}); recalibrate") from err
