"""The shared package: standard library only, the one home of the names both sides use,
and the only thing the agent and the operator have in common (neither imports the other)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import sdc_common.names as names

ROOT = Path(__file__).resolve().parents[2]


def imports(folder: Path) -> Iterator[tuple[Path, str]]:
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.module


def test_the_shared_package_needs_only_the_standard_library() -> None:
    outside = {
        (path.name, module)
        for path, module in imports(ROOT / "common")
        if module.split(".")[0] not in sys.stdlib_module_names | {"sdc_common"}
    }
    assert not outside


def test_the_agent_and_the_operator_never_import_each_other() -> None:
    operator = {
        (p.name, m) for p, m in imports(ROOT / "operator") if m.split(".")[0] == "sdc_agent"
    }
    agent = {(p.name, m) for p, m in imports(ROOT / "sidecar") if m.split(".")[0] == "sdc_operator"}
    assert (operator, agent) == (set(), set())


def test_no_shared_name_is_copied() -> None:
    """Every string the two sides must agree on is spelt once, in ``sdc_common.names``."""
    shared = {
        value
        for key, value in vars(names).items()
        if key in names.__all__ and isinstance(value, str) and key.endswith(("_ENV", "_FILE"))
    } | {names.GROUP, names.SUSPECT_KEY, names.INCIDENT_ANNOTATION}
    copies = []
    for folder in ("sidecar", "operator"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in shared:
                    copies.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not copies


def test_the_exit_codes_are_read_as_they_are_written() -> None:
    from sdc_operator.confirmation import EXIT_OUTCOMES

    assert {EXIT_OUTCOMES[code]: code for code in EXIT_OUTCOMES} == names.CONFIRM_EXIT_CODES
    assert set(names.CONFIRM_EXIT_CODES.values()).isdisjoint({1, 2})  # Python's, argparse's


def test_the_shared_package_and_the_operator_import_without_torch_or_the_agent() -> None:
    code = (
        "import sys, sdc_common.protocol, sdc_common.names, sdc_common.errors\n"
        "import sdc_operator.intake, sdc_operator.injection, sdc_operator.confirmation\n"
        "loaded = {m.split('.')[0] for m in sys.modules} & {'torch', 'sdc_agent'}\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
