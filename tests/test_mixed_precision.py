"""Mixed precision on CPU (issue 44, item 2): ``train.amp`` runs bfloat16 autocast on CPU, resumes
bitwise after kills, and a setting the CPU cannot honour is refused in one line, never ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli.main import app
from tests.engine_util import final_digest, killed_run_matches, make_run, reference_digest, run_worker
from training.config import ConfigError, load_config

TOTAL = 60
BF16 = ["train.amp=true", "train.amp_dtype=bfloat16"]


@pytest.mark.slow
def test_bf16_autocast_on_cpu_trains_in_bf16_and_resumes_bitwise_after_two_kills(tmp_path: Path) -> None:
    fp32 = reference_digest(tmp_path, [], until=TOTAL, name="fp32")
    ref_dir = make_run(tmp_path, "bf16", BF16)
    code, out = run_worker(ref_dir, TOTAL)
    assert code == 0 and "with AMP bfloat16" in out, out
    ref = final_digest(ref_dir)
    assert ref != fp32, "train.amp on CPU trained the fp32 trajectory: autocast was ignored"
    killed_run_matches(tmp_path, BF16, ref_dir, TOTAL, [12, 31], seed=44)


def test_float16_autocast_on_cpu_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.amp=true", "train.amp_dtype=float16"])
    assert "not honoured on CPU" in str(err.value) and "\n" not in str(err.value)
    result = CliRunner().invoke(app, ["validate", "-S", "train.amp=true", "-S", "train.amp_dtype=float16"])
    assert result.exit_code == 2, result.output
    assert "train.amp_dtype = 'float16' is not honoured on CPU" in result.output, result.output
