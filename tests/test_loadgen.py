"""The load generator's pure parts: URLs, settings, request bodies, SSE parsing, progress, CLI
checks. The end-to-end behaviour against a real server is in test_loadgen_e2e.py."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import subprocess
import sys

import pytest

from servematrix import cli
from servematrix.client import bench
from servematrix.client.loadgen import (
    ClientSettings,
    LoadgenError,
    Progress,
    StreamParser,
    encode_body,
    normalize_base_url,
)
from servematrix.workload import RequestSpec


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
        ("https://host.example/proxy", "https://host.example/proxy/v1"),
        (" http://h:1/v1 ", "http://h:1/v1"),
    ],
)
def test_base_url_gets_v1_once(given, expected):
    assert normalize_base_url(given) == expected


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("localhost:8000", "not an http:// or https:// URL"),
        ("ftp://host/v1", "not an http:// or https:// URL"),
        ("http://", "not an http:// or https:// URL"),
        ("http://host:99999", "invalid port"),
        ("http://host:80x", "invalid port"),
        ("http://host:8000/v1?x=1", "query or fragment"),
    ],
)
def test_bad_base_url_is_named(given, why):
    with pytest.raises(LoadgenError, match=why) as error:
        normalize_base_url(given)
    assert repr(given) in str(error.value)


def test_settings_check_concurrency_and_timeouts():
    settings = ClientSettings("http://h:8000", "m", None)
    assert settings.base_url == "http://h:8000/v1" and settings.server_root == "http://h:8000"
    for bad in (0, -3):
        with pytest.raises(LoadgenError, match=f"max_concurrency must be >= 1, got {bad}"):
            ClientSettings("http://h:8000", "m", bad)
    with pytest.raises(LoadgenError, match="request_timeout_s must be > 0"):
        ClientSettings("http://h:8000", "m", 2, request_timeout_s=0)
    with pytest.raises(LoadgenError, match="model name is empty"):
        ClientSettings("http://h:8000", "", 2)
    with pytest.raises(LoadgenError, match="client must be one of aiohttp, openai, got 'curl'"):
        ClientSettings("http://h:8000", "m", 2, client="curl")


def test_body_is_the_streaming_completion_vllm_expects():
    spec = RequestSpec(7, False, 0.5, [1, 2, 3], 3, 6)
    body = json.loads(encode_body(spec, ClientSettings("http://h:1", "served-m", None)))
    assert body == {
        "model": "served-m",
        "prompt": [1, 2, 3],
        "max_tokens": 6,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    text = RequestSpec(8, False, 0.0, "a poem", 2, 4)
    off = ClientSettings("http://h:1", "m", None, ignore_eos=False)
    assert json.loads(encode_body(text, off))["prompt"] == "a poem"
    assert json.loads(encode_body(text, off))["ignore_eos"] is False


def _chunk(text, completion_tokens=None, prompt_tokens=5, finish=None) -> bytes:
    event = {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    if completion_tokens is not None:
        event["usage"] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


USAGE_CHUNK = (
    b'data: {"id":"cmpl-x","object":"text_completion","choices":[],'
    b'"usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4}}\n\n'
)


def test_parser_times_chunks_by_arrival_and_counts_tokens_from_usage():
    stream = (
        _chunk(" a", 1)
        + _chunk("", 2)  # a token without text (partial UTF-8): a token event all the same
        + _chunk(" bc", 4)  # two tokens in one chunk (the API server lagged)
        + _chunk(" d", 5, finish="length")
        + USAGE_CHUNK.replace(b"9,", b"10,").replace(b":4}", b":5}")
        + b"data: [DONE]\n\n"
    )
    parser = StreamParser()
    # Split at arbitrary byte boundaries: a line counts at the read that completes it.
    cuts = [0, 10, len(_chunk(" a", 1)) + 3, 300, 420, len(stream)]
    for i, (start, end) in enumerate(itertools.pairwise(cuts)):
        parser.feed(stream[start:end], float(i))
    assert parser.chunk_tokens == [1, 1, 2, 1]
    assert len(parser.chunk_s) == 4 and parser.chunk_s[0] == 1.0
    assert parser.chunk_s == sorted(parser.chunk_s)
    assert (parser.prompt_tokens, parser.completion_tokens) == (5, 5)
    parser.finish()
    assert parser.done and parser.error is None


def test_a_completed_stream_of_empty_texts_is_a_success():
    """Real vLLM (a random-weight model writes special tokens) streams chunks whose text is all
    empty: vLLM 0.6's client rule called 49 of 100 such requests "stream ended without a token";
    every chunk with choices is a token event, and [DONE] with tokens is a success."""
    stream = b"".join(_chunk("", n) for n in range(1, 5)) + USAGE_CHUNK + b"data: [DONE]\n\n"
    parser = StreamParser()
    for i, line in enumerate(stream.split(b"\n\n")[:-1]):
        parser.feed(line + b"\n\n", float(i))
    parser.finish()
    assert parser.error is None
    assert parser.chunk_s == [0.0, 1.0, 2.0, 3.0] and parser.chunk_tokens == [1, 1, 1, 1]
    assert parser.tokens == 4


@pytest.mark.parametrize(
    ("stream", "error"),
    [
        # vLLM 0.6 ignoring a prompt its cache can never hold: a finish chunk, no token.
        (_chunk("", 0, finish="length") + b"data: [DONE]\n\n", "stream ended without a token"),
        (USAGE_CHUNK.replace(b":4}", b":0}") + b"data: [DONE]\n\n", "stream ended without a token"),
        (_chunk(" a", 1), "stream ended before [DONE]"),
    ],
)
def test_a_stream_without_tokens_or_done_is_a_failure(stream, error):
    parser = StreamParser()
    parser.feed(stream, 0.0)
    parser.finish()
    assert parser.error == error


def test_parser_without_usage_counts_one_token_per_chunk_and_accepts_crlf():
    stream = (_chunk("x") + _chunk("y") + b"data: [DONE]\n\n").replace(b"\n", b"\r\n")
    parser = StreamParser()
    parser.feed(b": keep-alive comment\r\n\r\n" + stream, 2.5)
    assert parser.chunk_s == [2.5, 2.5] and parser.chunk_tokens == [1, 1]
    assert parser.completion_tokens is None and parser.done


def test_parser_records_an_error_event():
    parser = StreamParser()
    parser.feed(_chunk(" a", 1), 1.0)
    parser.feed(
        b'data: {"error":{"message":"Internal server error","type":"x","code":500}}\n\n'
        b"data: [DONE]\n\n",
        2.0,
    )
    assert parser.error == "error in stream: Internal server error"
    assert parser.chunk_s == [1.0]


def test_parser_rejects_a_body_that_is_not_json():
    with pytest.raises(ValueError):
        StreamParser().feed(b"data: {not json\n", 0.0)


def test_progress_on_a_terminal_redraws_one_line():
    out = io.StringIO()
    progress = Progress(4, stream=out, tty=True)
    progress.finished(True)
    progress.finished(False)
    progress.report()
    progress.close()
    text = out.getvalue()
    assert text.startswith("\r[##########----------] 2/4 done, 1 failed, ")
    assert text.endswith(" req/s\x1b[K\n") and text.count("\n") == 1


def test_progress_in_a_log_is_a_plain_line(caplog):
    progress = Progress(3, stream=io.StringIO(), tty=False)
    progress.finished(True)
    with caplog.at_level(logging.INFO, logger="servematrix.client.loadgen"):
        progress.report()
    assert caplog.messages[0].startswith("requests: 1/3 done, 0 failed, ")


def test_vocab_size_from_the_config_a_local_directory_or_the_default(tmp_path):
    assert bench.vocab_size_for("anything", 1234) == (1234, "--vocab-size")
    size, source = bench.vocab_size_for("Qwen/Qwen2.5-7B-Instruct", None)
    assert size == 152064 and source.endswith("qwen2.5-7b/config.json")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 777}))
    assert bench.vocab_size_for(str(tmp_path), None) == (777, str(tmp_path / "config.json"))
    size, source = bench.vocab_size_for("someone/unknown-model", None)
    assert size == bench.DEFAULT_VOCAB_SIZE and source.startswith("default")


def _bench_args(**overrides) -> list[str]:
    values = {
        "--base-url": "http://127.0.0.1:9",
        "--model": "m",
        "--qps": "4",
        "--num-prompts": "3",
        **overrides,
    }
    return ["bench", *[x for pair in values.items() for x in pair if x is not None]]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"--num-prompts": "0"}, "--num-prompts must be >= 1, got 0"),
        ({"--max-concurrency": "0"}, "--max-concurrency must be >= 1, got 0"),
        ({"--max-concurrency": "-2"}, "--max-concurrency must be >= 1, got -2"),
        ({"--qps": "0"}, "--qps must be > 0 (or inf), got 0"),
        ({"--range-ratio": "1"}, "--range-ratio must be in [0, 1), got 1"),
        ({"--dataset": "sonnet"}, "--dataset sonnet needs --dataset-path"),
        ({"--base-url": "127.0.0.1:8000"}, "base URL '127.0.0.1:8000' is not an http://"),
        (
            {"--dataset": "jsonl", "--dataset-path": "/no/such/file.jsonl"},
            "/no/such/file.jsonl",
        ),
    ],
)
def test_bench_bad_input_is_one_line_and_no_trace(tmp_path, capsys, flags, message):
    output = tmp_path / "trace.parquet"
    code = cli.main([*_bench_args(**flags), "-o", str(output)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("servematrix bench: ") and err.count("\n") == 1
    assert message in err
    assert not output.exists() and list(tmp_path.iterdir()) == []


def test_bench_unwritable_output_is_refused_before_the_run(tmp_path, capsys):
    assert cli.main([*_bench_args(), "-o", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"servematrix bench: -o {tmp_path} is a directory\n"
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main([*_bench_args(), "-o", str(blocker / "sub" / "t.parquet")]) == 1
    assert f"cannot write in {blocker}" in capsys.readouterr().err


def test_bench_malformed_dataset_file_is_named_with_its_line(tmp_path, capsys):
    data = tmp_path / "requests.jsonl"
    data.write_text('{"input_len": 10, "output_len": 2}\n{"input_len": \n')
    output = tmp_path / "trace.parquet"
    args = _bench_args(**{"--dataset": "jsonl", "--dataset-path": str(data)})
    assert cli.main([*args, "-o", str(output)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(data) in err and "line 2" in err
    assert not output.exists()


def test_bench_parser_knows_every_documented_flag():
    top = cli.parser()
    args = top.parse_args(
        [
            *_bench_args(**{"--qps": "inf"}),
            "-o",
            "t.parquet",
            "--input-len",
            "1024",
            "--output-len",
            "6",
            "--max-concurrency",
            "4",
            "--dataset",
            "random",
            "--range-ratio",
            "0.5",
            "--seed",
            "3",
            "--warmup-requests",
            "2",
            "--burstiness",
            "0.5",
            "--request-timeout-s",
            "30",
            "--no-ignore-eos",
        ]
    )
    assert isinstance(args, argparse.Namespace) and args.run is bench.run
    assert args.qps == float("inf") and args.max_concurrency == 4 and not args.ignore_eos


def test_open_file_limit_is_raised_for_the_sockets_in_flight():
    """A soft limit of 256 with 1000 requests in flight would fail with EMFILE."""
    code = (
        "import resource\n"
        "from servematrix.client import senders\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "senders.raise_file_limit(1000)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    soft, hard = map(int, done.stdout.split())
    assert soft == (1000 if hard == -1 or hard >= 1000 else hard)
