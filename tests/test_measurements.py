"""Timings kept on disk for later processes (specframe/measurements.py)."""

import pytest

from specframe import measurements


@pytest.fixture
def sources(tmp_path):
    code = tmp_path / "code.py"
    code.write_text("timed = 1\n")
    return (code,)


def test_measurements_are_kept_by_name_beside_each_other(kept_timings, sources):
    assert measurements.stored("speeds", sources) == {}
    measurements.store("speeds", sources, "a", {"x": 1.5})
    measurements.store("speeds", sources, "b", [1, 2])
    assert measurements.stored("speeds", sources) == {"a": {"x": 1.5}, "b": [1, 2]}
    path = measurements.stored_file("speeds", sources)
    assert path.is_relative_to(kept_timings / "speeds") and list(path.parent.iterdir()) == [path]  # (no leftovers)
    assert measurements.stored("other kind", sources) == {}


def test_another_machine_or_other_code_has_its_own_file(kept_timings, sources, monkeypatch):
    measurements.store("speeds", sources, "a", 1)
    first = measurements.stored_file("speeds", sources)
    sources[0].write_text("timed = 2\n")  # the code that was timed changed
    assert measurements.stored_file("speeds", sources) != first and measurements.stored("speeds", sources) == {}
    sources[0].write_text("timed = 1\n")
    assert measurements.stored("speeds", sources) == {"a": 1}
    for name, value in (("cpu_name", lambda: "another CPU"), ("os.cpu_count", lambda: 128)):
        with monkeypatch.context() as m:
            m.setattr(measurements if name == "cpu_name" else measurements.os, name.split(".")[-1], value)
            assert measurements.stored_file("speeds", sources) != first
            assert measurements.stored("speeds", sources) == {}


@pytest.mark.parametrize("text", ["not json {", '["a list"]', '{"measurements": [1]}', ""])
def test_a_damaged_file_reads_as_nothing_kept_and_is_rewritten(kept_timings, sources, text):
    path = measurements.stored_file("speeds", sources)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert measurements.stored("speeds", sources) == {}
    measurements.store("speeds", sources, "a", 1)
    assert measurements.stored("speeds", sources) == {"a": 1}


def test_nothing_is_kept_where_the_cache_cannot_be_written(kept_timings, sources, monkeypatch):
    (kept_timings / "a file").write_text("")
    monkeypatch.setenv("SPECFRAME_HOME", str(kept_timings / "a file"))  # (no folder can be made under a file)
    measurements.store("speeds", sources, "a", 1)  # (no error)
    assert measurements.stored("speeds", sources) == {}


def test_tests_keep_nothing_unless_they_ask(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFRAME_HOME", str(tmp_path / "home"))
    measurements.store("speeds", sources, "a", 1)
    assert measurements.stored("speeds", sources) == {} and not (tmp_path / "home").exists()
