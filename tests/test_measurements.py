"""Timings kept on disk for later processes (specframe/measurements.py)."""

import pytest

from specframe import measurements


@pytest.fixture
def sources(tmp_path):
    code = tmp_path / "code.py"
    code.write_text("timed = 1\n")
    return (code,)


def test_timings_are_kept_by_name_beside_each_other(kept_timings, sources):
    assert measurements.stored("speeds", sources) == {}
    measurements.store("speeds", sources, "a", {"x": 1.5})
    measurements.store("speeds", sources, "b", [1, 2])
    assert measurements.stored("speeds", sources) == {"a": {"x": 1.5}, "b": [1, 2]}
    path = measurements.stored_file("speeds", sources)
    assert path.is_relative_to(kept_timings / "speeds") and list(path.parent.iterdir()) == [path]  # (no leftovers)
    assert measurements.kept_folder("speeds", sources) == path.parent
    assert measurements.stored("other kind", sources) == {}


def test_another_machine_or_other_code_has_its_own_file(kept_timings, sources, monkeypatch):
    measurements.store("speeds", sources, "a", 1)
    first = measurements.stored_file("speeds", sources)
    sources[0].write_text("timed = 2\n")  # the code that was timed changed
    assert measurements.stored_file("speeds", sources) != first and measurements.stored("speeds", sources) == {}
    sources[0].write_text("timed = 1\n")
    assert measurements.stored("speeds", sources) == {"a": 1}
    with monkeypatch.context() as m:
        m.setattr(measurements, "machine_key", lambda: "another machine")
        assert measurements.stored_file("speeds", sources) != first
        assert measurements.stored("speeds", sources) == {}


def test_the_machine_key_tells_cpus_of_one_name_apart(monkeypatch):
    """A hypervisor may show only "AMD EPYC": the family, model, stepping and flags still differ."""
    lines = ["processor\t: 0", "model name\t: AMD EPYC", "cpu family\t: 25", "model\t\t: 1", "flags\t\t: fpu avx2"]
    monkeypatch.setattr(measurements, "cpu_name", measurements.cpu_name.__wrapped__)  # (not this process's cache)
    keys = []
    for changed in (lines, [*lines[:3], "model\t\t: 17", lines[4]], [*lines[:4], "flags\t\t: fpu avx2 avx512f"]):
        monkeypatch.setattr(measurements, "_cpuinfo_lines", lambda changed=changed: [*changed, "", "processor\t: 1"])
        keys.append(measurements.machine_key.__wrapped__())
    assert len(set(keys)) == 3 and all("AMD EPYC" in k for k in keys)


@pytest.mark.parametrize("text", ["not json {", '["a list"]', '{"measurements": [1]}', "", "[" * 100_000])
def test_a_damaged_file_reads_as_nothing_kept_and_is_rewritten(kept_timings, sources, text):
    path = measurements.stored_file("speeds", sources)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert measurements.stored("speeds", sources) == {}
    measurements.store("speeds", sources, "a", 1)
    assert measurements.stored("speeds", sources) == {"a": 1}


@pytest.mark.parametrize("home", ["a file", "~no_such_user_here/cache"])
def test_nothing_is_kept_where_the_cache_cannot_be_written(kept_timings, sources, monkeypatch, home):
    (kept_timings / "a file").write_text("")
    # (no folder can be made under a file; a home directory that does not exist cannot be expanded)
    monkeypatch.setenv("SPECFRAME_HOME", str(kept_timings / home) if home == "a file" else home)
    measurements.store("speeds", sources, "a", 1)  # (no error)
    assert measurements.stored("speeds", sources) == {} and measurements.kept_folder("speeds", sources) is None


def test_values_that_are_not_finite_json_are_not_kept(kept_timings, sources):
    measurements.store("speeds", sources, "a", float("inf"))
    measurements.store("speeds", sources, "b", object())
    assert measurements.stored("speeds", sources) == {}


@pytest.mark.parametrize("value", ["0", "false", "No", " off "])
def test_the_environment_turns_keeping_off(kept_timings, sources, monkeypatch, value):
    measurements.store("speeds", sources, "a", 1)
    monkeypatch.setenv(measurements.KEEP_ENV, value)
    assert not measurements.keeping() and measurements.stored("speeds", sources) == {}
    measurements.store("speeds", sources, "b", 2)
    assert measurements.kept_folder("speeds", sources) is None
    monkeypatch.setenv(measurements.KEEP_ENV, "1")
    assert measurements.stored("speeds", sources) == {"a": 1}


def test_tests_keep_nothing_unless_they_ask(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFRAME_HOME", str(tmp_path / "home"))  # (the environment of ../conftest.py otherwise)
    measurements.store("speeds", sources, "a", 1)
    assert measurements.stored("speeds", sources) == {} and not (tmp_path / "home").exists()
