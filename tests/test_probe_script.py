"""`distdoctor probe SCRIPT`: every fixture in fixtures/probe runs for real (torchrun, 2 gloo ranks on
CPU) and its verdicts are compared with the expectations in its first line:

    # probe-expect: desync=fail(step=4,ranks=1) param-sync=pass

`check=status` must hold; inside the parentheses, `step`, `ranks` (joined by '+') and `parameter`
must match the failing check's details. Checks not named are not asserted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from distdoctor.probe.checks import checks_of
from distdoctor.probe.launch.torchrun import LaunchSpec
from distdoctor.probe.script.launcher import run_script_probe

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "probe"
STEPS = 12
CHECK_IDS = tuple(check.id for check in checks_of("script", "torch"))
_EXPECT = re.compile(r"(?P<id>[\w-]+)=(?P<status>pass|fail|warn|skip|error)(?:\((?P<detail>[^)]*)\))?")


def _script_fixtures() -> list[Path]:
    # Horovod fixtures share the folder; they are run by the Horovod tests.
    return sorted(p for p in FIXTURES.glob("*.py") if "horovod" not in p.read_text())


def expectations(path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """check id -> (status, {detail: value}) from the fixture's `# probe-expect:` line."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# probe-expect:"), f"{path.name} states no expectation"
    out = {}
    for m in _EXPECT.finditer(first.split(":", 1)[1]):
        detail = dict(kv.split("=", 1) for kv in (m["detail"] or "").split(",") if kv)
        out[m["id"]] = (m["status"], detail)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fixture", _script_fixtures(), ids=lambda p: p.stem)
def test_fixture_verdicts(fixture: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    expected = expectations(fixture)
    assert set(expected) <= set(CHECK_IDS)
    spec = LaunchSpec(nproc=2, backend="gloo", timeout_s=90.0)
    report = run_script_probe(str(fixture), [], spec, steps=STEPS, framework="torch",
                              log_file=str(tmp_path / "output.log"))
    checks = {c.id: c for c in report.checks}
    assert tuple(checks) == CHECK_IDS
    seen = {cid: f"{c.status}: {c.summary}" for cid, c in checks.items()}
    for check_id, (status, detail) in expected.items():
        check = checks[check_id]
        assert check.status == status, f"{fixture.name}: {check_id} expected {status}, got {seen}"
        if "step" in detail:
            assert check.details.get("step") == int(detail["step"]), (check_id, check.details, check.summary)
        if "ranks" in detail:
            want = [int(r) for r in detail["ranks"].split("+")]
            assert check.details.get("ranks") == want, (check_id, check.details, check.summary)
        if "parameter" in detail:
            assert check.details.get("parameter") == detail["parameter"], (check_id, check.details)
            assert detail["parameter"] in check.summary
    json.loads(report.to_json())  # the report is plain data
    if any(status == "fail" for status, _ in expected.values()):
        assert not report.ok
    if fixture.name.startswith("healthy"):
        assert report.ok, seen
        desync = checks["desync"]
        # --steps stopped every rank after exactly STEPS optimizer steps.
        assert all(rank["steps"] == STEPS for rank in desync.ranks.values()), desync.ranks
        assert report.extra["overhead"]["ranks"], report.extra


def test_expectation_parser() -> None:
    path = FIXTURES / "fault_skip_backward.py"
    assert expectations(path)["desync"] == ("fail", {"step": "4", "ranks": "1"})

