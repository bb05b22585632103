from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import yaml

from servematrix import cli
from servematrix.spec import trace
from servematrix.spec.trace import CellIdentity, RequestRecord

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


def _usage_error(argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.splitlines()


def test_no_command_prints_the_usage(capsys):
    lines = _usage_error([], capsys)
    assert lines[0] == (
        "usage: servematrix [-h] [--version] {check,metrics,deploy,bench,calibrate} ..."
    )
    assert lines[-1] == "servematrix: error: the following arguments are required: command"


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"servematrix {importlib.metadata.version('servematrix')}\n"


def test_a_flag_a_command_does_not_take_is_reported_by_that_command(capsys):
    argv = ["bench", "--base-url", "http://x", "--model", "m", "-o", "t.parquet", "--bogus", "1"]
    lines = _usage_error(argv, capsys)
    assert lines[0].startswith("usage: servematrix bench [-h] --base-url BASE_URL")
    assert lines[-1] == "servematrix bench: error: unrecognized arguments: --bogus 1"


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["check", "c.yaml", "--config", "other.yaml"], "servematrix check other.yaml"),
        (
            ["deploy", "--dry-run", "m", "single", "--config", "other.yaml"],
            "--configfile other.yaml",
        ),
    ],
)
def test_config_is_key_value_everywhere_and_a_file_is_named_how_to_give(argv, hint, capsys):
    lines = _usage_error(argv, capsys)
    assert lines[-1] == (
        f"servematrix {argv[0]}: error: argument --config: 'other.yaml' is not KEY=VALUE (as "
        f"snakemake --config); a config file is {hint}"
    )


def test_deploy_takes_a_configfile_and_config_overrides(tmp_path, small_config, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))
    model = next(iter(small_config["models"]))
    argv = ["deploy", "--dry-run", model, "single", "--configfile", str(path)]
    assert cli.main([*argv, "--config", "backend=emulator"]) == 0
    assert capsys.readouterr().out.startswith("# emulator deployment")


def test_deploy_refuses_a_backend_no_module_serves(tmp_path, small_config, capsys):
    """A misspelt backend is one line naming the key and the registry's choices, not a silent
    fall-back to vllm's commands."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**small_config, "backend": "tgi"}))
    model = next(iter(small_config["models"]))
    assert cli.main(["deploy", "--dry-run", model, "single", "--configfile", str(path)]) != 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "servematrix: config error at backend: 'tgi' is not one of "
        "['simulator', 'emulator', 'vllm', 'external']"
    )


@pytest.mark.parametrize("command", [[], ["check"], ["metrics"], ["deploy"], ["bench"]])
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([*command, "-h"])
    text = capsys.readouterr().out
    for markup in ("``", "`", "servematrix.", "senders", "CLIENTS", "DEFAULT_VOCAB_SIZE"):
        assert markup not in text, markup
