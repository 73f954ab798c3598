"""Structure rules read from the code (issue 46): every store refusal under one base
class, no product file over 450 lines (DESIGN.md "Code layout": a file that would
grow past it is split by concern), and the store package split by concern."""

from __future__ import annotations

from paths import REPO

PACKAGES = ("extract", "train", "store_schema")
MAX_FILE_LINES = 450


def line_counts() -> dict[str, int]:
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def test_no_product_file_grows_past_450_lines():
    counts = line_counts()
    over = {path: lines for path, lines in counts.items() if lines > MAX_FILE_LINES}
    assert not over, f"split these by concern (at most {MAX_FILE_LINES} lines): {over}"


def test_every_store_refusal_derives_from_one_base():
    """Issue 46.1: commands catch `StoreError`; each class keeps its builtin base too."""
    import store_schema.errors as errors
    from store_schema.objstore.errors import MissingBucketError, ObjectStoreError
    from store_schema.objstore.lease import LeaseLost

    refusals = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and value is not errors.StoreError and issubclass(value, Exception)
    ]
    assert len(refusals) >= 8 and all(issubclass(cls, errors.StoreError) for cls in refusals)
    assert all(issubclass(cls, errors.StoreError) for cls in (ObjectStoreError, MissingBucketError, LeaseLost))
    assert issubclass(errors.RecordError, ValueError) and issubclass(errors.CorruptShardError, RuntimeError)


def test_the_store_package_is_split_by_concern_on_a_ground_floor():
    """Issue 46.1: the contract at the top, the rest in sub-packages; `runtime/` imports
    nothing else of the store, and `import store_schema` re-exports none of it."""
    import ast

    import store_schema

    for package in ("codecs", "commit", "objstore", "tools", "runtime"):
        assert (REPO / "store_schema" / package / "__init__.py").is_file(), package
    for path in (REPO / "store_schema" / "runtime").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("store_schema"), (
                    f"{path.name} imports {'.' * node.level}{node.module}: runtime/ is the ground floor"
                )
    assert not [name for name, module in store_schema._EXPORTS.items() if module.startswith("runtime")]


def test_tests_mirror_the_packages_and_share_helpers_not_test_modules():
    """Issue 46.8: tests/ holds one folder per package; a helper two test modules use
    lives in a helper module, never in one of the test modules."""
    import ast

    for package in PACKAGES:
        assert (REPO / "tests" / package).is_dir(), package
    test_modules = {path.stem for path in (REPO / "tests").rglob("test_*.py")}
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            assert not set(names) & test_modules, f"{path.relative_to(REPO)} imports the test module {names}"
