"""extract/'s shape (issue 34.2): one job framework (`extract.jobs`) that extraction and
generation sit beside, neither importing the other. Read from the source with the
product's one import-graph reader (tests/import_graph.py); the rules every package
keeps (circles, private names, ...) are tests/test_structure.py's."""

from __future__ import annotations

from import_graph import imports_of, modules


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_extraction_and_generation_import_only_the_framework_corpus_code_and_store_schema():
    edges = imports_of(modules("extract"))
    for side, other in (("extract.extraction", "extract.generate"), ("extract.generate", "extract.extraction")):
        crossing = sorted(
            (m, t)
            for m, targets in edges.items()
            if inside(m, side)
            for t in targets
            if inside(t, other) or t == "extract.__main__"
        )
        assert crossing == [], crossing
    framework = sorted(
        (m, t)
        for m, targets in edges.items()
        if inside(m, "extract.jobs")
        for t in targets
        if inside(t, "extract.extraction") or inside(t, "extract.generate")
    )
    assert framework == [], framework  # the framework knows neither job
    uses = {t for m, targets in edges.items() if inside(m, "extract.extraction") for t in targets}
    assert any(inside(t, "extract.jobs") for t in uses)  # the graph is read: extraction uses the framework
