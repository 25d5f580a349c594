"""The package's own limits, checked by .ci/check (import-linter checks its layers, pyproject.toml):

- no import cycle among ddp_accel's modules (imports inside functions and for the type checker included), and every
  module placed in a layer of pyproject.toml's contract (a new module has its place written down);
- no class over 250 lines, no function over 60 lines or over 7 parameters (self and cls not counted) in ddp_accel/
  and scripts/. Exempt: argparse declarations (`parse_args`, `add_*_args`), whose length is the options' list, and
  a torch.autograd.Function's `forward`, whose parameters torch's `apply` fixes.

    python .ci/structure.py        # prints each breach, exit 1 if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 250, 60, 7


def exempt(function: ast.FunctionDef | ast.AsyncFunctionDef, owner: ast.ClassDef | None) -> bool:
    if function.name == "parse_args" or (function.name.startswith("add_") and function.name.endswith("_args")):
        return True
    bases = [getattr(base, "attr", getattr(base, "id", "")) for base in owner.bases] if owner else []
    return function.name == "forward" and "Function" in bases


def size_breaches(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    owners = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            found.append(f"{where}: class {node.name} has {lines} lines (at most {MAX_CLASS_LINES})")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            owner = owners.get(node)
            if exempt(node, owner if isinstance(owner, ast.ClassDef) else None):
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            parameters = [argument for argument in arguments if argument.arg not in ("self", "cls")]
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{where}: {node.name} has {lines} lines (at most {MAX_FUNCTION_LINES})")
            if len(parameters) > MAX_PARAMETERS:
                found.append(f"{where}: {node.name} has {len(parameters)} parameters (at most {MAX_PARAMETERS})")
    return found


def import_cycles() -> list[str]:
    graph = grimp.build_graph("ddp_accel")
    modules = sorted(graph.modules)
    found = []
    for index, module in enumerate(modules):
        for other in modules[index + 1 :]:
            there = graph.chain_exists(importer=module, imported=other)
            back = graph.chain_exists(importer=other, imported=module)
            if there and back and module != "ddp_accel" and other != "ddp_accel":
                chain = graph.find_shortest_chain(importer=module, imported=other) or ()
                chain_back = graph.find_shortest_chain(importer=other, imported=module) or ()
                found.append("import cycle: " + " -> ".join([*chain, *chain_back[1:]]))
    return found


def unplaced_modules() -> list[str]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(contract["layers"] for contract in contracts if contract["type"] == "layers")
    placed = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    modules = grimp.build_graph("ddp_accel").modules - {"ddp_accel"}
    return [
        f"{module} is in no layer of pyproject.toml's [tool.importlinter] contract"
        for module in sorted(modules)
        if not any(module == name or module.startswith(name + ".") for name in placed)
    ]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    files = sorted([*(ROOT / "ddp_accel").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])
    breaches = [breach for path in files for breach in size_breaches(path)] + import_cycles() + unplaced_modules()
    for breach in breaches:
        print(breach)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
