"""``servematrix deploy --dry-run``: the commands a user would otherwise type, in order."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

from servematrix.deploy.processes import Plan
from servematrix.deploy.recipes import DEPLOYED_BACKENDS, RECIPES, plan
from servematrix.spec import config
from servematrix.spec.matrix import MODES, Cell, Config, ConfigError


def find_cell(cfg: Config, model: str, mode: str, recipe: str | None) -> Cell:
    """A cell of the config for (model, mode[, recipe]); any study's settings if none has it."""
    names = {m.name: m for m in cfg.models.values()} | {m.hf_id: m for m in cfg.models.values()}
    if model not in names:
        raise ConfigError("models", f"unknown model {model!r} (known: {', '.join(cfg.models)})")
    if mode not in MODES:
        raise ConfigError("modes", f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    spec = names[model]
    if recipe is not None and spec.recipe is not None and recipe != spec.recipe:
        raise ConfigError(
            "--recipe",
            f"model {spec.name} forces recipe {spec.recipe} in every study "
            f"(models.{spec.name}.recipe), so it never runs on {recipe}: drop --recipe or pass "
            f"--recipe {spec.recipe}",
        )
    if len(spec.gpus) < MODES[mode].instances:
        raise ConfigError(
            f"models.{spec.name}.gpus",
            f"mode {mode!r} runs {MODES[mode].instances} instances but only "
            f"{len(spec.gpus)} GPU list(s) are pinned",
        )
    cells = cfg.all_cells()
    for cell in cells:
        same = cell.model.name == spec.name and cell.mode.name == mode
        if same and (recipe is None or cell.recipe == recipe):
            return cell
    if not cells:
        raise ConfigError("studies", "the config has no cells")
    return dataclasses.replace(
        cells[0],
        model=spec,
        mode=MODES[mode],
        recipe=recipe or spec.recipe or cells[0].recipe,
    )


def format_plan(deployment: Plan) -> str:
    """Shell-quoted commands with their environment, one per process, in start order."""
    lines = [
        f"# {deployment.backend} deployment: recipe {deployment.recipe}, model "
        f"{deployment.model}, mode {deployment.mode} (fingerprint {deployment.fingerprint})",
        f"# clients send to {deployment.base_url}",
    ]
    for name, content in deployment.files.items():
        lines.append(f"cat > {name} <<'EOF'")
        lines += content.rstrip("\n").splitlines()
        lines.append("EOF")
    for i, process in enumerate(deployment.processes, start=1):
        ports = ", ".join(str(p) for p in process.ports)
        lines.append(
            f"# {i}. {process.name}: port(s) {ports}; ready when {process.health.url} is 200"
        )
        env = [f"{k}={shlex.quote(v)}" for k, v in process.env.items()]
        background = " &" if i < len(deployment.processes) else ""
        lines.append(" ".join([*env, shlex.join(process.argv)]) + background)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from servematrix.backends import check
    from servematrix.workflow import merged, parse_overrides

    path = args.configfile
    if path is None:
        local = Path("config/config.yaml")
        path = local if local.is_file() else config.SCHEMA_PATH.parent / "config.yaml"
    cfg = config.load(merged(config.read_yaml(path), parse_overrides(args.overrides)))
    check(cfg.backend)
    if args.recipe is not None and args.recipe not in RECIPES:
        raise ConfigError("--recipe", f"unknown recipe {args.recipe!r} (known: v0, v1)")
    cell = find_cell(cfg, args.model, args.mode, args.recipe)
    backend = args.backend or (cfg.backend if cfg.backend in DEPLOYED_BACKENDS else "vllm")
    if not dataclasses.asdict(cell)["deploy"]:
        # A simulator config carries no deploy settings: show the defaults.
        raw = {**cfg.raw, "backend": backend}
        cell = dataclasses.replace(cell, deploy=config.deploy_settings(raw))
    # Written into the directory the commands run from, as the published instructions do.
    print(format_plan(plan(cell, backend).resolve(".")))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    deploy = commands.add_parser(
        "deploy", help="print the commands of a deployment (--dry-run; nothing is started)"
    )
    deploy.add_argument("model", help="a model of the config (its name or its hf_id)")
    deploy.add_argument("mode", choices=sorted(MODES))
    deploy.add_argument("--recipe", choices=sorted(RECIPES), help="default: the config's")
    deploy.add_argument(
        "--configfile", type=Path, metavar="FILE", help="default: config/config.yaml"
    )
    deploy.add_argument("--backend", choices=DEPLOYED_BACKENDS, help="default: vllm")
    deploy.add_argument(
        "--dry-run", action="store_true", required=True, help="print, do not start (required)"
    )
    deploy.set_defaults(run=run)
    return deploy
