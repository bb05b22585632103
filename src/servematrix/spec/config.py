"""Configuration: read the YAML, validate it, fill defaults, expand its studies into cells.

What a config expands into (cells, studies, their paths) is `servematrix.spec.matrix`; here the file
becomes one: schema first, then the checks the schema cannot express, each naming its key path,
so that a bad config stops the workflow before any job starts.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from servematrix.recipes import recipe_version, recipes_that
from servematrix.spec.configcheck import check_input
from servematrix.spec.matrix import (
    TRACE_DEFAULTS,
    Cell,
    Config,
    ConfigError,
    ModelSpec,
    ModeSpec,
    Serving,
    Study,
    Workload,
    mode_spec,
)
from servematrix.spec.slo import Slo, replacement_for_slo_ms
from servematrix.spec.topology import parse, within_budget
from servematrix.workload.datasets import Dataset, dataset_of, names
from servematrix.workload.sessions import Sessions, longest_conversation_tokens, plan

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "config" / "schema.yaml"


def _key_path(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(top level)"


def _validator(schema: Mapping[str, Any]) -> Any:
    """A draft 2020-12 validator that also fills ``default`` values in place."""
    import jsonschema  # here, not at the top: cell jobs only rebuild Cells and skip validation

    base = jsonschema.Draft202012Validator

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = json.loads(json.dumps(sub["default"]))
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    # JSON Schema counts 4.0 as an integer and NaN as a number; a config must not (a path
    # spelled _n200.0_, a QPS of nan), so both are refused with their key path.
    types = base.TYPE_CHECKER.redefine_many(
        {
            "integer": lambda _, value: isinstance(value, int) and not isinstance(value, bool),
            "number": lambda _, value: (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and not (isinstance(value, float) and math.isnan(value))
            ),
        }
    )
    extended = jsonschema.validators.extend(base, {"properties": set_defaults}, type_checker=types)
    return extended(schema)


def validate_schema(raw: dict[str, Any], schema_path: Path = SCHEMA_PATH) -> dict[str, Any]:
    """Validate ``raw`` against the schema, filling defaults; the first error names its key path."""
    schema = yaml.safe_load(schema_path.read_text())
    errors = sorted(
        _validator(schema).iter_errors(raw), key=lambda e: (len(e.absolute_path), str(e.path))
    )
    if errors:
        error = errors[0]
        raise ConfigError(_key_path(error.absolute_path), error.message)
    return raw


def _model_spec(name: str, data: Mapping[str, Any]) -> ModelSpec:
    base = f"models.{name}"
    tp = data["tensor_parallel"]
    pinned: set[int] = set()
    for i, gpus in enumerate(data["gpus"]):
        if len(gpus) != tp:
            raise ConfigError(
                f"{base}.gpus[{i}]",
                f"pins {len(gpus)} GPU(s) {gpus} but tensor_parallel is {tp}",
            )
        twice = pinned.intersection(gpus) | {g for g in gpus if gpus.count(g) > 1}
        if twice:
            raise ConfigError(
                f"{base}.gpus[{i}]",
                f"GPU(s) {sorted(twice)} pinned twice inside one deployment",
            )
        pinned.update(gpus)
    return ModelSpec(
        name=name,
        # A local model directory may be given from the home directory (``~/...``).
        hf_id=os.path.expanduser(data["hf_id"]),
        architecture=os.path.expanduser(data["architecture"]),
        quantization=data["quantization"],
        tensor_parallel=tp,
        gpus=tuple(tuple(g) for g in data["gpus"]),
        recipe=data.get("recipe"),
    )


def _study(
    name: str,
    data: Mapping[str, Any],
    raw: Mapping[str, Any],
    models: Mapping[str, ModelSpec],
) -> Study:
    base = f"studies.{name}"
    for i, model in enumerate(data["models"]):
        if model not in models:
            known = ", ".join(sorted(models))
            raise ConfigError(f"{base}.models[{i}]", f"unknown model {model!r} (known: {known})")
    if "gpu_budget" in data:
        data = {**data, "modes": _budget_modes(base, data, models)}
    for i, mode_name in enumerate(data["modes"]):
        mode = mode_spec(mode_name)
        for model in data["models"]:
            if mode.topology is not None:
                _check_topology(f"{base}.modes[{i}]", data, mode, models[model])
                continue
            if len(models[model].gpus) < mode.instances:
                raise ConfigError(
                    f"{base}.modes[{i}]",
                    f"mode {mode_name!r} runs {mode.instances} instances but models.{model}.gpus "
                    f"pins only {len(models[model].gpus)}",
                )
    settings = {**raw["defaults"], **data.get("workload", {})}
    serving = Serving(
        settings["max_model_len"],
        settings["gpu_memory_utilization"],
        settings.get("max_num_batched_tokens"),
        bool(settings.get("enforce_eager", False)),
        bool(settings.get("prefix_caching", False)),
        settings.get("max_num_seqs"),
        settings.get("kv_offloading_size"),
    )
    _check_workload_settings(base, data, settings)
    sessions = _sessions(base, data, settings)
    cells = []
    for model in data["models"]:
        spec = models[model]
        for mode in data["modes"]:
            for input_len in data["input_len"]:
                _check_fits(base, settings, input_len, sessions)
                for qps, seed in itertools.product(data["qps"], seeds(settings)):
                    workload = _workload(settings, sessions, float(qps), input_len, seed)
                    recipe = spec.recipe or data["recipe"]
                    _check_offloading(base, data, serving, recipe, mode_spec(mode))
                    cells.append(
                        Cell(
                            backend=raw["backend"],
                            recipe=recipe,
                            model=spec,
                            mode=mode_spec(mode),
                            workload=workload,
                            serving=serving,
                            engine=dict(raw["engine"]),
                            deploy=deploy_settings(raw),
                        )
                    )
    return Study(
        name=name,
        title=data.get("title", name),
        recipe=data["recipe"],
        models=tuple(data["models"]),
        modes=tuple(data["modes"]),
        qps=tuple(float(q) for q in data["qps"]),
        input_lens=tuple(data["input_len"]),
        x=data["x"],
        cells=tuple(cells),
        question=_question(base, data),
        confirm_top=data.get("confirm_top"),
    )


def _budget_modes(base: str, data: Mapping[str, Any], models: Mapping[str, ModelSpec]) -> list[str]:
    """The split question: every topology on at most ``gpu_budget`` GPUs at the ``tp`` sizes
    (default: every power of two up to the budget), each pinned from each model's GPU list."""
    budget = data["gpu_budget"]
    if "modes" in data:
        raise ConfigError(f"{base}.gpu_budget", "a study gives modes or a gpu_budget, not both")
    if recipe_version(data["recipe"]).kv.lookup_buffer:
        raise ConfigError(
            f"{base}.gpu_budget",
            f"needs recipe {_xpyd_recipes()} (recipe {data['recipe']}'s Mooncake runs one "
            "prefill and one decode instance)",
        )
    tps = tuple(data.get("tp", [2**k for k in range(budget.bit_length()) if 2**k <= budget]))
    for i, tp in enumerate(tps):
        if tp > budget:
            raise ConfigError(f"{base}.tp[{i}]", f"TP {tp} exceeds the gpu_budget {budget}")
    for model in data["models"]:
        pinned = sum(len(gpus) for gpus in models[model].gpus)
        if pinned < budget:
            raise ConfigError(
                f"{base}.gpu_budget",
                f"{budget} GPUs but models.{model}.gpus pins only {pinned}",
            )
    modes = [topology.spelling for topology in within_budget(budget, tps)]
    if data.get("confirm_top", 0) > len(modes):
        raise ConfigError(
            f"{base}.confirm_top",
            f"{data['confirm_top']} but the gpu_budget gives only {len(modes)} topologies",
        )
    return modes


def _xpyd_recipes() -> str:
    """The recipes whose connector runs more than one prefill or decode instance."""
    return recipes_that(lambda version: not version.kv.lookup_buffer)


def _check_topology(where: str, data: Mapping[str, Any], mode: ModeSpec, model: ModelSpec) -> None:
    """A topology runs on recipe v1 and is pinned from the model's GPU list."""
    if recipe_version(data["recipe"]).kv.lookup_buffer:
        raise ConfigError(where, f"the topology {mode.name} needs recipe {_xpyd_recipes()}")
    pinned = sum(len(gpus) for gpus in model.gpus)
    needed = parse(mode.name).gpus
    if pinned < needed:
        raise ConfigError(
            where, f"{mode.name} needs {needed} GPUs but models.{model.name}.gpus pins {pinned}"
        )


def _question(base: str, data: Mapping[str, Any]) -> str | None:
    """The study's named question, which needs two or more of what it compares."""
    question = data.get("question")
    if question is None:
        return None
    compared = data[question]  # the question is named after the study key it compares
    if len(compared) < 2:
        raise ConfigError(
            f"{base}.question",
            f"{question!r} compares the study's {question}, but it lists one ({compared[0]}): "
            f"list two or more, or drop question",
        )
    return question


def _workload(
    settings: Mapping[str, Any], sessions: Sessions | None, qps: float, input_len: int, seed: int
) -> Workload:
    """One point of a study (its QPS, input length and seed) as the `Workload` its cells send."""
    return Workload(
        qps=qps,
        input_len=input_len,
        output_len=settings["output_len"],
        num_prompts=_num_prompts(settings, sessions, input_len, seed),
        seed=seed,
        dataset=settings["dataset"],
        burstiness=float(settings["burstiness"]),
        warmup_requests=settings["warmup_requests"],
        max_concurrency=settings.get("max_concurrency"),
        range_ratio=float(settings["range_ratio"]),
        dataset_path=settings.get("dataset_path"),
        prefix_len=settings["prefix_len"],
        ignore_eos=bool(settings["ignore_eos"]),
        prefix_groups=settings.get("prefix_groups", 1),
        sessions=sessions,
        **_trace_settings(settings),
    )


def _check_offloading(
    base: str, data: Mapping[str, Any], serving: Serving, recipe: str, mode: ModeSpec
) -> None:
    """CPU KV offloading is a V1 flag (vLLM 0.6 has none); with a disaggregated mode it would
    need a second KV connector beside Mooncake's, which the engine does not model."""
    if serving.kv_offloading_gib is None:
        return
    key = "kv_offloading_size"
    where = f"{base}.workload.{key}" if key in data.get("workload", {}) else f"defaults.{key}"
    version = recipe_version(recipe)
    if not version.kv_offloading:
        raise ConfigError(
            where,
            f"needs recipe {recipes_that(lambda v: v.kv_offloading)} (vLLM "
            f"{version.vllm_series}, recipe {recipe}, has no such flag)",
        )
    if mode.disaggregated:
        raise ConfigError(
            where,
            f"is not modelled with the disaggregated mode {mode.name!r} (single-instance "
            "and round-robin modes only)",
        )


def seeds(settings: Mapping[str, Any]) -> range:
    """The seeds of a point's repeats: ``seed`` .. ``seed + repeats - 1`` (each its own cell)."""
    return range(settings["seed"], settings["seed"] + settings.get("repeats", 1))


def _check_workload_settings(
    base: str, data: Mapping[str, Any], settings: Mapping[str, Any]
) -> None:
    """Checks across workload keys (the schema checks each key alone); errors name the key
    where the setting was made, the study's ``workload`` or ``defaults``."""

    def where(key: str) -> str:
        return f"{base}.workload.{key}" if key in data.get("workload", {}) else f"defaults.{key}"

    dataset = dataset_of(settings["dataset"])
    if not dataset.READS_FILE:
        if settings.get("dataset_path") is not None:
            raise ConfigError(where("dataset_path"), f"the {dataset.NAME} dataset reads no file")
    else:
        path = settings.get("dataset_path")
        if path is None:
            raise ConfigError(where("dataset"), f"dataset {dataset.NAME!r} needs a dataset_path")
        if not Path(path).is_file():
            raise ConfigError(where("dataset_path"), f"dataset file {path} does not exist")
    if settings["range_ratio"] and not dataset.DRAWS_LENGTHS:
        raise ConfigError(where("range_ratio"), _only(lambda d: d.DRAWS_LENGTHS))
    if settings["prefix_len"] and not dataset.SHARES_PREFIX:
        raise ConfigError(where("prefix_len"), _only(lambda d: d.SHARES_PREFIX))
    if settings.get("prefix_groups", 1) != 1 and not (
        dataset.GROUPS_PREFIXES and settings["prefix_len"]
    ):
        message = _only(lambda d: d.GROUPS_PREFIXES, " with a prefix_len")
        raise ConfigError(where("prefix_groups"), message)
    trace_keys = [key for key in _TRACE_KEYS if key in settings]
    if not dataset.REPLAYS_TRACE and trace_keys:
        raise ConfigError(where(trace_keys[0]), _only(lambda d: d.REPLAYS_TRACE))
    if dataset.REPLAYS_TRACE:
        _check_trace(where, data, settings)


def _only(applies: Callable[[Dataset], bool], condition: str = "") -> str:
    """Where a setting applies, for its message (``applies to the random and sonnet datasets
    only``): the datasets with the property ``applies`` tests."""
    chosen = names(applies)
    return f"applies to the {chosen} dataset{'s' if ' and ' in chosen else ''}{condition} only"


_TRACE_KEYS = tuple(TRACE_DEFAULTS)


def _trace_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The mooncake dataset's `Workload` fields that are set (the others keep their defaults)."""
    fields = {key: settings[key] for key in _TRACE_KEYS if key in settings}
    if "trace_start_s" in fields:
        fields["trace_start_s"] = float(fields["trace_start_s"])
    return fields


def _check_trace(where: Any, data: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """The trace file reads line by line and every cell's window (``num_prompts`` requests
    within its ``input_len`` cap) is there; warm-ups are refused, as they would change the
    window's cache state and are not part of the trace."""
    from servematrix.workload import replay  # here: only a trace study reads one

    if settings["warmup_requests"]:
        raise ConfigError(
            where("warmup_requests"),
            "must be 0 for the mooncake dataset (the trace is replayed as it is)",
        )
    try:
        requests = replay.read_trace(settings["dataset_path"])
        for input_len in data["input_len"]:
            replay.window(
                requests,
                float(settings.get("trace_start_s", 0.0)),
                settings["num_prompts"],
                input_len,
                settings.get("input_overflow", "drop"),
                where=f"trace file {settings['dataset_path']}",
            )
    except replay.TraceError as error:
        raise ConfigError(where("dataset_path"), str(error)) from error


def _sessions(base: str, data: Mapping[str, Any], settings: Mapping[str, Any]) -> Sessions | None:
    """The study's ``sessions``, refused where this version does not drive them: one line
    naming the setting."""
    raw = settings.get("sessions")
    if raw is None:
        return None
    where = (
        f"{base}.workload.sessions"
        if "sessions" in data.get("workload", {})
        else "defaults.sessions"
    )
    sessions = Sessions(**raw)
    if sessions.min_turns > sessions.turns:
        raise ConfigError(where, f"min_turns {sessions.min_turns} exceeds turns {sessions.turns}")
    if not dataset_of(settings["dataset"]).DRAWS_LENGTHS:
        message = "sessions draw their turns' lengths, which " + _only(lambda d: d.DRAWS_LENGTHS)
        raise ConfigError(where, message)
    if settings.get("max_concurrency") is not None:
        raise ConfigError(where, "sessions set their own concurrency (users): drop max_concurrency")
    disaggregated = [mode for mode in data["modes"] if mode_spec(mode).disaggregated]
    if disaggregated:
        raise ConfigError(
            where,
            f"sessions run on single and round-robin modes only, not {', '.join(disaggregated)}",
        )
    return sessions


def _num_prompts(
    settings: Mapping[str, Any], sessions: Sessions | None, input_len: int, seed: int
) -> int:
    """The measured requests: ``num_prompts``, or a sessions workload's number of turns."""
    if sessions is None:
        return settings["num_prompts"]
    return len(plan(sessions, input_len, settings["output_len"], settings["range_ratio"], seed))


def _check_fits(
    base: str, settings: Mapping[str, Any], input_len: int, sessions: Sessions | None = None
) -> None:
    """The longest request the workload can draw must fit in ``max_model_len`` (jsonl
    lengths are only known when the file is read: vLLM rejects those that do not fit); a
    session's last turn holds the whole conversation."""
    if sessions is not None:
        longest = longest_conversation_tokens(
            sessions, input_len, settings["output_len"], settings["range_ratio"]
        )
        if longest > settings["max_model_len"]:
            raise ConfigError(
                f"{base}.workload.sessions",
                f"a conversation of {sessions.turns} turns can reach {longest} tokens, beyond "
                f"max_model_len {settings['max_model_len']}",
            )
    ratio = settings["range_ratio"]
    longest_in = math.ceil(input_len * (1 + ratio))
    longest_out = math.ceil(settings["output_len"] * (1 + ratio))
    if settings["prefix_len"] >= math.floor(input_len * (1 - ratio)):
        raise ConfigError(
            f"{base}.input_len",
            f"input {input_len}{' at its shortest' if ratio else ''} must be longer than the "
            f"shared prefix (prefix_len {settings['prefix_len']})",
        )
    if longest_in + longest_out > settings["max_model_len"]:
        spread = f" (range_ratio {ratio:g})" if ratio else ""
        raise ConfigError(
            f"{base}.input_len",
            f"input {longest_in} + output {longest_out}{spread} exceeds "
            f"max_model_len {settings['max_model_len']}",
        )


def deploy_settings(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What a cell needs to reach its server; empty for the simulator, so that editing ports
    or deploy settings never reruns simulated cells."""
    if raw["backend"] == "simulator":
        return {}
    settings = {
        **raw.get("deploy", {}),
        "ports": dict(raw["ports"]),
        "base_url": raw.get("base_url"),
    }
    node = raw.get("node", {})
    if node.get("kind", "gpu") == "cpu":
        # Only on CPU nodes, so GPU cells keep their parameters (no rerun).
        settings["node"] = {"kind": "cpu", "kvcache_space_gib": node.get("kvcache_space_gib", 4)}
        if node.get("api_server_cores"):
            settings["node"]["api_server_cores"] = list(node["api_server_cores"])
    return settings


def _check_shared_cells(studies: Mapping[str, Study]) -> None:
    """Two studies naming the same cell path must agree on everything the path omits."""
    first: dict[str, tuple[str, Cell]] = {}
    for study in studies.values():
        for cell in study.cells:
            seen = first.setdefault(cell.path, (study.name, cell))
            if seen[1] != cell:
                raise ConfigError(
                    f"studies.{study.name}.workload",
                    f"cell {cell.path} is also in study {seen[0]!r} with different settings "
                    "(serving flags, or another dataset file of the same name); "
                    "give it another seed",
                )


def load(raw: Mapping[str, Any], schema_path: Path = SCHEMA_PATH) -> Config:
    """Validate a config mapping (as Snakemake loaded it) and expand its studies. The name of
    its backend is the registry's to check (`servematrix.backends.check`, in
    ``workflow.check_config``), which sits above this module."""
    if "slo_ms" in raw:
        raise ConfigError("slo_ms", replacement_for_slo_ms(raw["slo_ms"]))
    data = validate_schema(json.loads(json.dumps(raw)), schema_path)
    models = {name: _model_spec(name, spec) for name, spec in data["models"].items()}
    studies = {name: _study(name, spec, data, models) for name, spec in data["studies"].items()}
    _check_shared_cells(studies)
    check_input(data, studies)
    return Config(
        backend=data["backend"],
        raw=data,
        models=models,
        studies=studies,
        slo=Slo.from_config(data["slo"]),
    )


def load_file(path: Path) -> Config:
    return load(read_yaml(path))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice in one mapping is an error."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        problem=f"key {key!r} appears twice (lines {first[key]} and {line})",
                        problem_mark=key_node.start_mark,
                    )
                first[key] = line
            except TypeError:  # an unhashable key: the base class says so
                break
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file as a mapping; a syntax error or a repeated key names its line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "no such file")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = error.problem or error.context or "not valid YAML"
        if "appears twice" in problem:
            raise ConfigError(str(path), problem) from None
        if error.context and error.context_mark and error.context_mark.line != mark.line:
            problem += f" ({error.context} at line {error.context_mark.line + 1})"
        raise ConfigError(str(path), f"not valid YAML at {where}{problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(str(path), f"not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "the config must be a mapping")
    return raw
