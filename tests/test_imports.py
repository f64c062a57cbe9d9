"""The import graph keeps the architecture's direction (read from the source with `ast`):

- nothing under model/ imports from proposers/ or draft_model/ (the adapter takes plain
  overrides; drafts are built on the model, not the other way round);
- policies/ imports no torch (they are plain Python, testable without a model);
- no module imports another package's private (underscore) names.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "spirit"


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in a file, relative imports resolved."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = path.relative_to(SRC.parent).with_suffix("").parts[: -node.level]
                module = ".".join([*package, module] if module else package)
            found.append((module, [alias.name for alias in node.names]))
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "spirit" and len(parts) > 1 else parts[0]


def files(under: str = "") -> list[Path]:
    return sorted((SRC / under).rglob("*.py"))


def test_the_model_layer_imports_no_draft_layer():
    bad = [(f.name, m) for f in files("model") for m, _ in imports(f)
           if m.startswith(("spirit.proposers", "spirit.draft_model"))]
    assert not bad


def test_policies_are_plain_python():
    bad = [(f.name, m) for f in files("policies") for m, _ in imports(f) if m.split(".")[0] == "torch"]
    assert not bad
    # and so is what they import from the rest of spirit
    allowed = {"spirit.policies", "spirit.skipset", "spirit.stats", "spirit.machine", "spirit.plan"}
    outside = {m for f in files("policies") for m, _ in imports(f)
               if m.startswith("spirit.") and not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert not outside


def test_no_module_imports_another_packages_private_names():
    bad = []
    for f in files():
        own = package_of(".".join(f.relative_to(SRC.parent).with_suffix("").parts))
        for module, names in imports(f):
            if not module.startswith("spirit") or package_of(module) == own:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [part for part in module.split(".") if part.startswith("_") and part != "__init__"]
            if private:
                bad.append((str(f.relative_to(SRC)), module, private))
    assert not bad
