"""The release gate: runs written by earlier releases continue on HEAD, bitwise (issue 45).

Every folder of ``tests/releases/<date>-<commit>`` holds a run that release trained to half-way
(``tests/releases/make_fixture.py`` wrote it with that release's own code).  HEAD resumes each
and must log, for every step, the loss of HEAD's own uninterrupted run and end on its digest: the
first half proves the release trained as HEAD trains, the second that HEAD read its checkpoint
completely.  A new release adds its fixture with the same script.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.engine_util import final_digest, logged_losses
from tests.releases.make_fixture import HALF, PARAMS, TOTAL, release_env
from training.events import Event, read_events

REPO = Path(__file__).resolve().parents[1]
FIXTURES = sorted(p for p in (REPO / "tests" / "releases").iterdir() if (p / "release.json").is_file())
RUN = Path(PARAMS["runs_dir"]) / PARAMS["run_name"]


def _place(fixture: Path, work: Path) -> Path:
    """A copy of the fixture's run where its relative ``runs_dir`` puts it under ``work``."""
    shutil.copytree(fixture / "run", work / RUN)
    return work / RUN


def _worker(work: Path, until: int) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(work / RUN), "--until-step", str(until)]
    done = subprocess.run(cmd, cwd=work, env=release_env(REPO), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def head_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HEAD's own uninterrupted run of the fixtures' task, to ``TOTAL``."""
    from tests.releases.make_fixture import train

    work = tmp_path_factory.mktemp("head")
    return train(REPO, work, TOTAL)


def test_the_landed_releases_have_fixtures() -> None:
    dates = {json.loads((f / "release.json").read_text())["date"] for f in FIXTURES}
    assert {"2026-11-29", "2026-12-02", "2026-12-03", "2026-12-07"} <= dates, dates
    for fixture in FIXTURES:
        size = sum(f.stat().st_size for f in fixture.rglob("*") if f.is_file())
        assert size < 100_000, f"{fixture.name}: {size} bytes; a fixture is a tiny run"


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.name for f in FIXTURES])
def test_a_run_of_an_earlier_release_continues_on_head_bitwise(fixture: Path, head_run: Path, tmp_path: Path) -> None:
    run_dir = _place(fixture, tmp_path)
    assert [step for step, _ in logged_losses(run_dir)] == list(range(1, HALF + 1))
    _worker(tmp_path, TOTAL)
    assert logged_losses(run_dir) == logged_losses(head_run)  # steps 1..HALF by the release, the rest by HEAD
    assert final_digest(run_dir) == final_digest(head_run)
    manifest = json.loads((run_dir / "checkpoints" / f"step-{TOTAL:09d}" / "manifest.json").read_text())
    assert re.fullmatch(r"\d+\.\d+\.\d+(\+g[0-9a-f]+(-dirty)?)?", manifest["versions"]["convoy"]), manifest
    assert manifest["versions"]["torch"].startswith("2.")


def test_convoy_train_reopens_an_older_run_as_an_upgrade_not_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``convoy train`` path (``open_run``) on a run of 2026-12-02, whose recorded settings lack
    ``data.generator`` (added that evening; no effect on this task): reopened without
    ``--allow-config-change``, recorded as ``release_upgraded``, its checkpoints resumable."""
    from training.rundir import load_run_config, open_run, run_info

    (fixture,) = [f for f in FIXTURES if f.name.startswith("2026-12-02")]
    run_dir = _place(fixture, tmp_path)
    old = run_info(run_dir).fingerprint
    monkeypatch.chdir(tmp_path)
    config = load_run_config(RUN)
    assert config.fingerprint() != old  # today's reading of the same settings hashes the generator
    open_run(config)
    (upgraded,) = read_events(run_dir, Event.RELEASE_UPGRADED)
    assert (upgraded["old"], upgraded["new"]) == (old, config.fingerprint())
    assert old in run_info(run_dir).accepted_fingerprints
    assert not read_events(run_dir, Event.CONFIG_CHANGED)


def test_an_older_run_whose_behaviour_is_gone_is_refused_in_one_line_naming_what_continues_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run of 2026-12-02 as if its task had read the synthetic corpus (the character
    model): corpus 1 is no longer generated, so HEAD refuses, naming the key and the release
    that continues the run."""
    from training.config import ConfigError
    from training.rundir import load_run_config, open_run

    (fixture,) = [f for f in FIXTURES if f.name.startswith("2026-12-02")]
    run_dir = _place(fixture, tmp_path)
    corpus_task = "training.examples.char_gpt:build"
    for name in ("config.json", "run.json"):  # what that release wrote for this task
        path = run_dir / name
        path.write_text(path.read_text().replace('"upgrade_task:build"', json.dumps(corpus_task)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        open_run(load_run_config(RUN))
    line = str(refused.value)
    assert "\n" not in line
    assert "data.generator 1 → 2" in line and "git checkout e96280b" in line, line
    assert not read_events(run_dir, Event.RELEASE_UPGRADED)


def test_every_example_that_reads_the_corpus_is_a_corpus_reader() -> None:
    """``training.compat.CORPUS_READERS`` decides whether the corpus generator matters to a run."""
    from training.compat import CORPUS_READERS

    readers = {
        f"training.examples.{path.stem}:build"
        for path in (REPO / "training" / "examples").glob("*.py")
        if "load_corpus(" in path.read_text()
    }
    assert readers == set(CORPUS_READERS)
