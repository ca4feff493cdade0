"""The code names the documentation cites exist.

Every inline code span (text in backticks, outside fenced code blocks) of docs/*.md, README.md,
CONTRIBUTING.md and BENCHMARKS.md is checked by these rules; a name no rule recognises is not checked.

1. Repository paths: a word of a span that starts with distzo/, tests/, conf/, benchmarks/,
   examples/, slurm/, launch/ or docs/ (`distzo/engine/`, `python benchmarks/x.py --flag`) names an
   existing file or folder. `{a,b}` expands; a `*` glob must match something; a word holding a
   placeholder (`<name>`, `...`) is not checked. `path::name` needs a function or class `name` in
   that Python file, `doc.md#anchor` a heading of that document with that anchor.
2. Paths inside the package: a word `engine/loop.py` (a .py or .c file) whose first folder is one of
   distzo/'s is distzo/engine/loop.py.
3. A span that is a bare source file name (`signum.py`, `kernels.c`) is the name of some file in the
   folders of rule 1 (a file name among other words, `torchrun ... script.py`, is not checked).
4. Python names: `distzo.x.y` (alone, called, or anywhere in a span; also `python -m distzo.x`)
   resolves. Where the source shows it, that is enough: the longest prefix that is a module file,
   then a name that module defines, imports (followed to where it comes from) or lists in `__all__`
   for its `__getattr__` to build, then a class attribute as in rule 5. Otherwise the longest
   importable module prefix is imported and the rest looked up with getattr (a dataclass field
   counts too), so every complaint is Python's own verdict, and docs that pass import no torch.
5. `Class.attribute` (alone or called): where distzo/ defines a class of that name, one such class
   (or a base class distzo/ defines) has the attribute: a method, property, class attribute, dataclass
   field or enum member, or an attribute its methods set on self. A class name distzo/ does not
   define fails unless it is one of EXTERNAL_CLASSES (other libraries' classes the docs cite).
6. Calls: a span that is a whole call of a snake_case name, `flush()`, `trainer.close()`,
   `build_engine(EngineSetup)`, is checked when its parentheses are empty or the name holds an
   underscore (so formulas such as `sqrt(v)` are not): the name is defined somewhere in distzo/ or
   tests/ (a function, class, or attribute assigned), unless it is one of EXTERNAL_CALLS or called on
   a module of another library (`torch.from_file(...)`).
7. Commit ids: a span of 7 to 40 hex digits in docs/, README.md or CONTRIBUTING.md is a commit of
   this repository (`git cat-file -e ID^{commit}`). BENCHMARKS.md, the record of where each
   measurement was taken, is exempt. In a shallow clone (or with no git at hand) the history that
   would prove an id is missing, so there the rule is stricter instead of skipped: docs/, README.md
   and CONTRIBUTING.md cite no commit ids at all; the commit a figure was measured at belongs in
   BENCHMARKS.md, and the docs point to its section.

Markdown links to repository files (`[text](other.md#anchor)`) must reach an existing file and, for
a Markdown file, one of its anchors.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / n for n in ("README.md", "CONTRIBUTING.md", "BENCHMARKS.md")]
TOP_FOLDERS = ("distzo", "tests", "conf", "benchmarks", "examples", "slurm", "launch", "docs")

# Other libraries' classes, methods and modules the docs cite by name (transformers, peft, datasets, torch).
EXTERNAL_CLASSES = {"AutoModelForCausalLM", "PeftModel", "Dataset", "DatasetDict"}
EXTERNAL_CALLS = {"from_pretrained", "save_pretrained", "get_input_embeddings", "get_output_embeddings", "nonzero",
                  "hyperparameter_search"}
EXTERNAL_MODULES = {"torch", "numpy", "np", "transformers", "peft", "datasets", "trl"}

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.M | re.S)
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CALL = re.compile(r"^((?:[A-Za-z_]\w*\.)*)([a-z_][a-z0-9_]*)\((.*)\)$")
CLASS_ATTR = re.compile(r"^([A-Z]\w*[a-z]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?$")
DOTTED = re.compile(r"(?<![\w./-])distzo(?:\.[A-Za-z_]\w*)+")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
SUBPACKAGE_PATH = re.compile(r"^([a-z_]+)/[\w./-]+(?:\.py|\.c)$")
WEB = re.compile(r"^[a-z][a-z0-9+.-]*:")  # http:, https:, mailto:
BARE_SOURCE = re.compile(r"^[\w-]+(?:\.py|\.c)$")


def spans(text: str):
    """(line, code) of every inline code span outside fenced blocks, whitespace runs made one space."""
    fenced = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in SPAN.finditer(fenced):
        yield fenced.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())


def links(text: str):
    fenced = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in LINK.finditer(fenced):
        yield fenced.count("\n", 0, m.start()) + 1, m.group(1)


# --- what the repository holds ---------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_of(text: str) -> frozenset[str]:
    """The anchors of a Markdown text's headings (a repeated heading's get -1, -2, ...)."""
    text = FENCE.sub("", text)
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    return anchors_of(path.read_text(encoding="utf-8"))


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def python_files(*folders: str) -> list[Path]:
    return [p for f in folders for p in sorted((ROOT / f).rglob("*.py")) if "__pycache__" not in p.parts]


@functools.cache
def source_file_names() -> frozenset[str]:
    names = set()
    for folder in TOP_FOLDERS:
        names.update(p.name for p in (ROOT / folder).rglob("*") if BARE_SOURCE.match(p.name))
    return frozenset(names)


@functools.cache
def defined_names() -> frozenset[str]:
    """Every function and class of distzo/ and tests/, the names their modules and class bodies assign,
    and every attribute assigned (`self.x = ...`); not a function's local variables."""
    names = set()
    for path in python_files("distzo", "tests"):
        tree = parsed(path)
        bodies = [tree.body]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    bodies.append(node.body)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        for body in bodies:
            for node in body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign) else []
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return frozenset(names)


@dataclasses.dataclass
class ClassInfo:
    module: str
    bases: list[str]
    attributes: set[str]


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    attributes = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attributes.add(node.name)
        elif isinstance(node, ast.Assign):
            attributes.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attributes.add(node.target.id)
    for node in ast.walk(cls):  # self.x = ... in its methods
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        attributes.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                          and isinstance(t.value, ast.Name) and t.value.id == "self")
    return attributes


@functools.cache
def classes() -> dict[str, list[ClassInfo]]:
    """The classes distzo/ defines, by name (several modules may define one name)."""
    found: dict[str, list[ClassInfo]] = {}
    for path in python_files("distzo"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                found.setdefault(node.name, []).append(ClassInfo(module, bases, _class_attributes(node)))
    return found


def class_has(name: str, attribute: str, seen: frozenset[str] = frozenset()) -> bool:
    for info in classes().get(name, []):
        if attribute in info.attributes:
            return True
        for base in info.bases:
            if base in classes() and base not in seen and class_has(base, attribute, seen | {name}):
                return True
            if base not in classes() and base not in ("object", "ABC"):  # another library's base: ask Python
                if hasattr(getattr(importlib.import_module(info.module), name, None), attribute):
                    return True
    return False


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def bindings(tree: ast.Module) -> dict[str, ast.AST]:
    """The names a module binds at its top level (also inside its top-level if / try blocks), and the
    names of its `__all__` where a module `__getattr__` builds them on first use."""
    found: dict[str, ast.AST] = {}
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update({n.id: node for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
    exported = found.get("__all__")
    if "__getattr__" in found and isinstance(exported, ast.Assign):  # names the module builds when asked
        found.update({e.value: exported for e in ast.walk(exported.value)
                      if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value not in found})
    return found


def found_in_source(parts: list[str]) -> bool:
    """Whether the source shows that `parts` (distzo, module..., attribute...) exists: the longest
    prefix that is a module file, then a name it binds (followed through `from .x import name`), then
    a class's attribute (rule 5). False means "not shown", not "missing": `resolve` then imports."""
    n = next((n for n in range(len(parts), 0, -1) if module_file(parts[:n])), 0)
    if n == 0:
        return False
    if n == len(parts):
        return True
    file, name, rest = module_file(parts[:n]), parts[n], parts[n + 1:]
    node = bindings(parsed(file)).get(name)
    if isinstance(node, ast.ImportFrom) and node.level:  # a relative import: look where it comes from
        package = parts[:n] if file.name == "__init__.py" else parts[:n - 1]
        source = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        return found_in_source([*source, alias.name, *rest])
    if node is None or len(rest) > 1:
        return False
    return not rest or isinstance(node, ast.ClassDef) and class_has(name, rest[0])


def resolve(dotted: str) -> str | None:
    """None when `dotted` (distzo.module.attr...) resolves, else why not. What the source shows
    (`found_in_source`) is taken as it is, which spares importing torch and transformers; anything
    else is imported and looked up, so a complaint is always Python's own verdict."""
    parts = dotted.split(".")
    if found_in_source(parts):
        return None
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module.startswith(exc.name):
                raise  # the module exists but imports something missing: say so, not "no attribute"
            continue
        for i, attr in enumerate(parts[n:], n):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
                obj = None  # an instance field: nothing further to look up on the class
            else:
                return f"{'.'.join(parts[:i])} has no attribute {attr!r}"
        return None
    return f"no module {parts[0]!r}"


@functools.cache
def shallow() -> bool:
    try:
        out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return True  # no git history to consult: the strict rule
    return out != "false"


def commit_exists(sha: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT,
                          capture_output=True).returncode == 0


# --- the rules ----------------------------------------------------------------------------------------

def expand(word: str) -> list[str]:
    """`a/{b,c}.py` -> [a/b.py, a/c.py]."""
    pieces = re.split(r"\{([^{}]*)\}", word)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(pieces)]
    return ["".join(choice) for choice in product(*options)]


def path_problem(word: str) -> str | None:
    """None when a repository path (with an optional ::name or #anchor) exists, else why not."""
    path, _, name = word.partition("::")
    path, _, anchor = path.partition("#")
    for each in expand(path):
        matches = sorted(ROOT.glob(each.rstrip("/"))) if "*" in each else [ROOT / each]
        if not any(m.exists() for m in matches):
            return f"{each} does not exist"
        target = matches[0]
        if each.endswith("/") and not target.is_dir():
            return f"{each} is not a folder"
        if name and not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
                            for n in ast.walk(parsed(target))):
            return f"{each} defines no function {name}"
        if anchor and (target.suffix != ".md" or anchor not in anchors(target.resolve())):
            return f"{each} has no heading with the anchor #{anchor}"
    return None


def span_problems(code: str, doc: Path) -> list[str]:
    problems = []
    words = [w.strip("()[],;'\"").removesuffix(".").removesuffix(":") for w in code.split()]
    for word in words:
        if "<" in word or "..." in word or not word:
            continue
        first = word.split("/", 1)[0]
        if "/" in word and first in TOP_FOLDERS:
            why = path_problem(word)
            if why:
                problems.append(why)
        elif (m := SUBPACKAGE_PATH.match(word)) and (ROOT / "distzo" / m.group(1)).is_dir():
            if not (ROOT / "distzo" / word).exists():
                problems.append(f"{word}: there is no distzo/{word}")
    if BARE_SOURCE.match(code) and code not in source_file_names():
        problems.append(f"{code}: no file of that name in the repository")
    for dotted in DOTTED.findall(code):
        why = resolve(dotted)
        if why:
            problems.append(f"{dotted}: {why}")
    if m := CLASS_ATTR.match(code):
        name, attribute = m.groups()
        if name in classes():
            if not class_has(name, attribute):
                problems.append(f"{code}: class {name} has no attribute {attribute!r}")
        elif name not in EXTERNAL_CLASSES:
            problems.append(f"{code}: no class {name} in distzo/ (nor one of EXTERNAL_CLASSES)")
    elif (m := CALL.match(code)) and not code.startswith("distzo."):
        receiver, name, args = m.groups()
        external = receiver.split(".", 1)[0] in EXTERNAL_MODULES
        if (not args or "_" in name) and not external and name not in EXTERNAL_CALLS | defined_names():
            problems.append(f"{code}: no function or attribute {name!r} in distzo/ or tests/")
    if COMMIT.match(code) and doc.name != "BENCHMARKS.md":
        if shallow():
            problems.append(f"{code}: a commit id in a doc (this shallow clone cannot check it; cite the "
                            "BENCHMARKS.md section that records it)")
        elif not commit_exists(code):
            problems.append(f"{code}: no such commit")
    return problems


def doc_problems(doc: Path, text: str | None = None) -> list[str]:
    """Every rule's complaints about one document, as `file:line: code: why`."""
    text = doc.read_text(encoding="utf-8") if text is None else text
    where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    problems = [f"{where}:{line}: `{code}`: {why}" for line, code in spans(text) for why in span_problems(code, doc)]
    for line, target in links(text):
        if WEB.match(target):
            continue
        file, _, anchor = target.partition("#")
        path = doc.parent / file
        if file and not path.exists():
            problems.append(f"{where}:{line}: link ({target}): {file} does not exist")
        elif anchor and (file == "" or path.suffix == ".md"):
            if anchor not in (anchors(path.resolve()) if file else anchors_of(text)):
                problems.append(f"{where}:{line}: link ({target}): no heading with the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_names_a_doc_cites_exist(doc):
    problems = doc_problems(doc)
    assert not problems, "names the docs cite that the code lacks:\n" + "\n".join(problems)


def test_the_rules_catch_stale_names():
    """A doc citing names that do not exist fails, one complaint per name."""
    stale = ("The deal is `Mesh.my_evaluations`; `UpdateRule.apply` and `apply_update()` apply it\n"
             "(`distzo/run/scoring.py`, `scoring.py`, `engine/scoring.py`, `distzo.run.scoring`,\n"
             "`tests/unit/test_engine.py::test_no_such_test`, `docs/offload.md#no-such-heading`,\n"
             "commit `0000000`) [see](offload.md#no-such-heading)\n")
    doc = ROOT / "docs" / "stale.md"  # judged as a file of docs/, never written
    problems = doc_problems(doc, stale)
    for name in ("Mesh.my_evaluations", "UpdateRule.apply", "apply_update()", "distzo/run/scoring.py",
                 "`scoring.py`", "engine/scoring.py", "distzo.run.scoring", "test_no_such_test",
                 "#no-such-heading`", "0000000", "link (offload.md#no-such-heading)"):
        assert any(name in p for p in problems), (name, problems)
    assert len(problems) == 11, problems
    fine = ("`Mesh.my_probes`, `Rule.apply`, `flush()`, `distzo/engine/loop.py`, `engine/loop.py`, "
            "`distzo.parallel.node.Node`, `tests/unit/test_doc_names.py::test_the_rules_catch_stale_names`, "
            "`docs/offload.md#sliced-communication-distzo2`, `AutoModelForCausalLM.from_pretrained`")
    assert doc_problems(doc, fine) == []


def test_a_shallow_clone_refuses_commit_ids_in_docs_but_not_in_benchmarks(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "shallow", lambda: True)
    line = "measured at commit `a021f13`\n"
    assert [p for p in doc_problems(ROOT / "docs" / "x.md", line) if "shallow clone" in p]
    assert doc_problems(ROOT / "BENCHMARKS.md", line) == []
