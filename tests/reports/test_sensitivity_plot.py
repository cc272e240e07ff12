"""The mixed plan's sensitivity heat map: a panel per candidate format, layers by module kind,
log10 KL as the colour, and a dot where the plan chose that format."""

from __future__ import annotations

import math

from reports.figures import layer_importance_bars, sensitivity_heatmap
from reports.report import _plan_of

SCAN = {
    f"{layer}.{kind}": {"int4-g128": 1e-2 * (layer + 1), "int8": 1e-4 * (layer + 1), "keep": 0.0}
    for layer in range(3)
    for kind in ("attn_in", "attn_out", "mlp_in", "mlp_out")
}
PLAN = {name: ("int8" if name.startswith("2.") else "int4-g128") for name in SCAN}


def test_heatmap_panels_values_and_plan_marks() -> None:
    fig = sensitivity_heatmap("mixed", SCAN, PLAN)
    assert [a.text for a in fig.layout.annotations] == ["int4-g128", "int8"]  # keep: no panel
    int4, int8 = fig.data
    assert list(int4.x) == ["attn_in", "attn_out", "mlp_in", "mlp_out"]
    assert list(int4.y) == ["0", "1", "2"]
    assert math.isclose(int4.z[1][2], math.log10(2e-2))
    assert list(int4.text[0]) == ["●"] * 4 and list(int4.text[2]) == [""] * 4
    assert list(int8.text[2]) == ["●"] * 4 and list(int8.text[0]) == [""] * 4


def test_report_carries_the_plan_of_a_mixed_variant_only() -> None:
    info = {"plan": PLAN, "sensitivity": SCAN, "measured_kl": 0.1, "calibration": {}}
    assert set(_plan_of(info)) == {"plan", "sensitivity", "measured_kl"}
    assert _plan_of({"quantized_linear_layers": 3}) == {}


def test_a_students_layers_and_their_influence_are_plotted() -> None:
    info = {
        "kept_layers": [0, 2],
        "layer_selection": "importance",
        "layer_importance": {"metric": "block influence", "scores": [0.3, 0.1, 0.2], "windows": {}},
        "final_loss": 1.0,
    }
    extras = _plan_of(info)
    assert extras == {
        "kept_layers": [0, 2],
        "layer_selection": "importance",
        "layer_importance": [0.3, 0.1, 0.2],
    }
    (bars,) = layer_importance_bars("kd", extras["layer_importance"], extras["kept_layers"]).data
    assert list(bars.y) == [0.3, 0.1, 0.2]
    assert list(bars.customdata) == ["kept", "dropped", "kept"]
    assert bars.marker.color[1] == "rgba(0,0,0,0)" and bars.marker.color[0] != bars.marker.color[1]
