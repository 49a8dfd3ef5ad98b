"""The plugin boundary (polychip/devices/boundary.py): what a plugin hands the framework is validated
where it is read. Natural forms are accepted; a wrong shape is one PluginValueError naming plugin,
method, field, what came and what was expected, reported by devices, probe and conformance."""
from __future__ import annotations

import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polychip.cli import main
from polychip.devices import boundary
from polychip.devices.plugin import Availability, DeviceHealth, DeviceInfo
from polychip.devices.spec import check_against_devices, from_dict
from polychip.dtypes import DTYPE_ALIASES, KNOWN_DTYPES
from polychip.errors import DeviceSpecError, PluginError, PluginValueError
from polychip.pluginkit import conformance

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)


class Stub:
    """Answers each plugin method with what the test says."""

    name = "fuzzchip"

    def __init__(self, **answers):
        for method, value in answers.items():
            setattr(self, method, (lambda v: lambda *a: v)(value))


def info(**fields) -> DeviceInfo:
    base = dict(index=0, name="Fuzz-1G", total_memory=2**30, free_memory=2**29, dtypes=("float32",))
    return DeviceInfo(**{**base, **fields})


def test_topology_natural_forms_are_normalised():
    got = boundary.devices(Stub(discover=[info(topology={"peers": [1, 3], "distance": [0, 1, 2, 1], "ring": "x"}),
                                          info(index=1, topology={"peers": {0: True, 2: False},
                                                                  "distance": {0: 1, 1: 0}})]))
    assert got[0].topology == {"peers": {1: True, 3: True}, "distance": {0: 0, 1: 1, 2: 2, 3: 1}, "ring": "x"}
    assert got[1].topology == {"peers": {0: True, 2: False}, "distance": {0: 1, 1: 0}}
    assert boundary.devices(Stub(discover=[info(dtypes=["bf16", "fp32"])]))[0].dtypes == ("bfloat16", "float32")
    health = boundary.devices(Stub(discover=[info(health={"temperature_c": 71, "throttling": False})]))[0].health
    assert health == DeviceHealth(temperature_c=71.0, throttling=False)


def spec(distance=None, p2p=False) -> object:
    return from_dict({"device_type": "fuzzchip", "device_ids": [0, 1], "memory": {"total": "512MiB"},
                      "supported_dtypes": ["float32"], "topology": {"p2p_enabled": p2p, "distance": distance}},
                     "ring.yaml")


def test_the_spec_check_reads_the_list_forms_rather_than_ignoring_them():
    ring = [info(index=i, topology={"peers": [j for j in range(4) if j != i],
                                    "distance": [min((i - j) % 4, (j - i) % 4) for j in range(4)]}) for i in range(4)]
    infos = boundary.devices(Stub(discover=ring))
    check_against_devices(spec([[0, 1], [1, 0]], p2p=True), "fuzzchip", infos)
    with pytest.raises(DeviceSpecError, match=r"topology.distance.0: fuzzchip device 0 reports 1 \(declared 2\) "
                                              r"to device 1"):
        check_against_devices(spec([[0, 2], [2, 0]]), "fuzzchip", infos)
    no_p2p = boundary.devices(Stub(discover=[info(index=i, topology={"peers": []}) for i in range(2)]))
    with pytest.raises(DeviceSpecError, match=r"p2p_enabled: declared true, but fuzzchip device 0 reports no P2P "
                                              r"link to device\(s\) \[1\]"):
        check_against_devices(spec(p2p=True), "fuzzchip", no_p2p)


NAN, INF = float("nan"), float("inf")
not_numbers = st.one_of(st.text(max_size=8), st.none(), st.just(NAN), st.just(INF), st.booleans(),
                        st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                              max_size=2))
# where a field is optional, None means "not reported" and is fine
not_numbers_nor_none = not_numbers.filter(lambda v: v is not None)
not_counts = st.one_of(not_numbers, st.integers(max_value=-1), st.floats(allow_nan=False, allow_infinity=False))
not_dicts = st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=8), st.none(), st.integers())
unknown_dtype = st.text(max_size=8).filter(lambda s: DTYPE_ALIASES.get(s.lower(), s.lower()) not in KNOWN_DTYPES)
# field of DeviceInfo -> values of the wrong shape for it
WRONG = {
    "index": not_counts,
    "name": st.one_of(st.none(), st.integers(), st.lists(st.text(), max_size=2)),
    "total_memory": not_counts,
    "free_memory": st.one_of(not_counts, st.integers(min_value=2**30 + 1)),     # more than total_memory
    "dtypes": st.one_of(st.text(max_size=8), st.none(), st.integers(), st.just([]),
                        st.lists(unknown_dtype, min_size=1, max_size=2)),
    "compute": st.one_of(not_dicts, st.dictionaries(st.text(max_size=5), st.one_of(not_numbers, st.just(-1.0)),
                                                    min_size=1, max_size=2)),
    "topology": st.one_of(not_dicts, st.fixed_dictionaries({"peers": st.one_of(st.text(max_size=4), st.integers(),
                                                                                st.just({1: "yes"}))}),
                          st.fixed_dictionaries({"distance": st.one_of(st.text(max_size=4), st.just([0, -1]),
                                                                       st.just([3, 1]), st.just([0, "far"]))}),
                          st.fixed_dictionaries({"bandwidth_gbps": st.one_of(not_numbers_nor_none, st.just(-5.0))}),
                          st.fixed_dictionaries({"p2p_enabled": st.one_of(st.text(max_size=4), st.integers())})),
    "health": st.one_of(st.lists(st.integers(), min_size=1, max_size=2), st.text(max_size=6), st.integers(),
                        st.fixed_dictionaries({"temperature_c": not_numbers_nor_none}),
                        st.fixed_dictionaries({"utilization": st.one_of(not_numbers_nor_none, st.just(1.5))}),
                        st.fixed_dictionaries({"correctable_errors": not_counts.filter(lambda v: v is not None)}),
                        st.fixed_dictionaries({"throttling": st.one_of(st.integers(), st.text(max_size=4))}),
                        st.fixed_dictionaries({"temperature": st.floats()})),
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(WRONG)).flatmap(lambda f: st.tuples(st.just(f), WRONG[f])))
def test_fuzz_a_wrong_shape_in_discover_is_one_named_error(case):
    field, value = case
    with pytest.raises(PluginValueError) as caught:
        boundary.devices(Stub(discover=[info(**{field: value})]))
    e = caught.value
    assert (e.plugin, e.method) == ("fuzzchip", "discover()")
    assert e.field.startswith(f"[0].{field}") and e.expected, (field, value, str(e))
    assert f"plugin 'fuzzchip': discover() returned a bad value at {e.field}: got " in str(e)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["versions", "mem_info", "largest_free_block", "health", "is_available", "discover"])
       .flatmap(lambda m: st.tuples(st.just(m), {
           "versions": st.one_of(not_dicts, st.dictionaries(st.text(min_size=1, max_size=4), st.one_of(
               st.integers(), st.none(), st.just(NAN), st.lists(st.text())), min_size=1, max_size=2)),
           "mem_info": st.one_of(st.text(max_size=4), st.none(), st.integers(), st.just(NAN),
                                 st.tuples(not_counts, st.just(10)), st.tuples(st.just(11), st.just(10)),
                                 st.lists(st.integers(min_value=0), min_size=3, max_size=4)),
           "largest_free_block": not_counts,
           "health": st.one_of(st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=2),
                               st.fixed_dictionaries({"thermal_limit_c": st.one_of(not_numbers_nor_none, st.just(-1.0))})),
           "is_available": st.one_of(st.text(max_size=4), st.none(), st.integers(), st.just(Availability("yes")),
                                     st.just(Availability(True, reason=5))),
           "discover": st.one_of(st.none(), st.text(max_size=4), st.integers(), st.dictionaries(st.text(), st.integers()),
                                 st.lists(st.one_of(st.none(), st.integers(), st.text()), min_size=1, max_size=2),
                                 st.just([info(), info()])),
       }[m])))
def test_fuzz_every_method_of_the_boundary_names_its_error(case):
    method, value = case
    read = {"versions": boundary.versions, "mem_info": boundary.mem_info, "health": boundary.health,
            "largest_free_block": boundary.largest_free_block, "is_available": boundary.availability,
            "discover": boundary.devices}[method]
    with pytest.raises(PluginValueError) as caught:
        read(Stub(**{method: value}))
    assert (caught.value.plugin, caught.value.method) == ("fuzzchip", f"{method}()") and caught.value.expected


def test_a_method_that_raises_is_one_plugin_error_naming_it():
    class Raising(Stub):
        def versions(self):
            raise KeyError("driver")

    with pytest.raises(PluginError, match=r"plugin 'fuzzchip': versions\(\) raised KeyError: 'driver'"):
        boundary.versions(Raising())


BAD_PLUGIN = textwrap.dedent('''
    """A plugin that reports its memory as a string, the way its driver prints it."""
    import torch
    from polychip.devices.plugin import Availability, DeviceInfo, DevicePlugin, Event, Stream

    class S(Stream):
        def synchronize(self):
            pass

    class E(Event):
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    class StringChip(DevicePlugin):
        name = "stringchip"
        torch_device_type = "cpu"

        def is_available(self):
            return Availability(True)

        def discover(self):
            return [DeviceInfo(index=0, name="S", total_memory="16GiB", free_memory=0, dtypes=("float32",))]

        def mem_info(self):
            return 0, 1

        def synchronize(self):
            pass

        def stream(self):
            return S()

        def event(self):
            return E()
''')
NAMED = "plugin 'stringchip': discover() returned a bad value at [0].total_memory: got '16GiB' (str); expected an integer"


def test_devices_probe_and_conformance_report_a_bad_shape_as_a_plugin_failure(tmp_path, capsys):
    plugin = tmp_path / "stringchip.py"
    plugin.write_text(BAD_PLUGIN)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("device_type: stringchip\ndevice_ids: [0]\nmemory: {total: 1GiB}\nsupported_dtypes: [float32]\n")
    assert main(["devices", "--plugin", str(plugin)]) == 1
    out = capsys.readouterr()
    assert f"stringchip 0  (--plugin {plugin})  Error at discover: [plugin] {NAMED}" in out.out, out
    assert main(["probe", "--config", str(spec_file), "--plugin", str(plugin)]) == 1
    out = capsys.readouterr().out
    assert "device check  FAIL" in out and NAMED in out and "Traceback" not in out, out
    results = {r.name: r for r in conformance.results(conformance.Target("stringchip", (str(plugin),)))}
    assert all(r.status == "fail" and NAMED in r.message for r in results.values()), results
