from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from servematrix import cli, trace
from servematrix.trace import CellIdentity, RequestRecord

IDENTITY = CellIdentity("simulator", "v0", "m", "single", "random", 2.0, 8, 3, 2, 0)


def _request(rid: int, sent: float, chunks: list[float]) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        warmup=False,
        scheduled_s=sent,
        sent_s=sent,
        first_token_s=chunks[0],
        end_s=chunks[-1],
        chunk_s=chunks,
        chunk_tokens=[1] * len(chunks),
        prompt_tokens=8,
        completion_tokens=len(chunks),
        success=True,
        request_input_len=8,
        request_output_len=len(chunks),
    )


def test_check_counts_cells(tmp_path, small_config, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))
    assert cli.main(["check", str(path)]) == 0
    assert "8 distinct cells on backend simulator" in capsys.readouterr().out


def test_check_reports_a_bad_config_in_one_line(tmp_path, small_config, capsys):
    small_config["studies"]["disagg"]["qps"] = [0]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))
    assert cli.main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "servematrix: config error at studies.disagg.qps[0]: 0 is less than or equal to the "
        "minimum of 0"
    )


def test_metrics_prints_vllm_style_summary(tmp_path, capsys):
    path = tmp_path / "t.parquet"
    # TTFT 0.1 s and 0.3 s -> mean 200 ms; TPOT (0.3-0.1)/2 = 100 ms and (0.5-0.3)/2 = 100 ms.
    records = [_request(0, 0.0, [0.1, 0.2, 0.3]), _request(1, 0.5, [0.8, 0.9, 1.0])]
    trace.write(path, IDENTITY, records, {})
    assert cli.main(["metrics", str(path), "--slo", "ttft=250"]) == 0
    out = capsys.readouterr().out
    assert "Successful requests:                    2" in out
    assert "Mean TTFT (ms):                         200.00" in out
    assert "Mean TPOT (ms):                         100.00" in out
    # Only request 0 meets TTFT <= 250 ms; duration is 1.0 s.
    assert "Request goodput (req/s):                1.00" in out


def test_metrics_rejects_a_bad_slo(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["metrics", str(tmp_path / "t.parquet"), "--slo", "latency=3"])


def test_metrics_names_a_missing_file(tmp_path, capsys):
    assert cli.main(["metrics", str(tmp_path / "none.parquet")]) == 1
    assert "none.parquet" in capsys.readouterr().err


def test_metrics_piped_into_a_reader_that_stops_early(tmp_path):
    """`servematrix metrics t.parquet | head -1`: no traceback when the pipe closes."""
    path = tmp_path / "t.parquet"
    trace.write(path, IDENTITY, [_request(0, 0.0, [0.1, 0.2, 0.3])], {})
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line
    run = subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "metrics", str(path)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    assert (run.returncode, run.stderr) == (0, "")
