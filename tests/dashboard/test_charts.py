"""The server-drawn SVG charts: well-formed, escaped, and laid out for a deep lineage."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from pipeline.dashboard.charts import LinePoint, Series, confusion_svg, line_chart_svg, lineage_svg

NS = "{http://www.w3.org/2000/svg}"


def test_a_deep_lineage_is_drawn_top_to_bottom_with_attempts_side_by_side():
    nodes = [{"number": 0, "parent": None, "status": "retired", "overall": 0.1, "method": "base"}]
    parent = 0
    for n in range(1, 400):  # every third attempt is promoted: a chain 133 deep with rejected siblings
        status = "retired" if n % 3 == 0 else "rejected"
        nodes.append(
            {"number": n, "parent": parent, "status": status, "overall": 0.1 + n / 1000, "method": "sft"}
        )
        if n % 3 == 0:
            parent = n
    nodes[-1]["status"], nodes[-1]["champion"] = "promoted", True
    svg = ET.fromstring(str(lineage_svg(nodes)))
    boxes = {int(a.get("data-generation")): a.find(f"{NS}rect") for a in svg.iter(f"{NS}a")}
    assert len(boxes) == 400
    y = {n: float(r.get("y")) for n, r in boxes.items()}
    x = {n: float(r.get("x")) for n, r in boxes.items()}
    assert y[3] > y[0] and y[1] == y[2] == y[3] and x[1] < x[2] < x[3]  # siblings share a row
    assert boxes[399].get("stroke") == "#000"  # the champion is outlined


def test_labels_are_escaped():
    nodes = [{"number": 0, "parent": None, "status": "<b>x</b>", "overall": None, "method": "<script>"}]
    svg = str(lineage_svg(nodes))
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    chart = str(
        line_chart_svg([Series("<img onerror=1>", [LinePoint(0, 0.5)])], title="t", x_label="x", y_label="y")
    )
    ET.fromstring(chart)
    assert "<img" not in chart
    matrix = confusion_svg({"a<": {"a<": 3, "b": 1}, "b": {"b": 4}})
    root = ET.fromstring(str(matrix))
    assert [t.text for t in root.iter(f"{NS}text") if t.text in ("3", "1", "4")] == ["3", "1", "4"]


def test_whiskers_and_empty_charts():
    chart = line_chart_svg([Series("s", [LinePoint(0, 0.5, 0.4, 0.6), LinePoint(1, 0.6, 0.5, 0.7)])],
                           title="t", x_label="x", y_label="y", y_range=(0, 1))  # fmt: skip
    root = ET.fromstring(str(chart))
    assert len(list(root.iter(f"{NS}line"))) >= 6  # axes, grid and three lines per whisker
    assert "nothing recorded" in str(line_chart_svg([], title="loss", x_label="x", y_label="y"))
