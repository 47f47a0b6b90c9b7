"""The published scenario schema stays valid and in step with the records and registries."""

import jsonschema
from commgate.model.loader import schema
from commgate.model.scenario import MoEConfig, Parallelism, Scenario, ZeroConfig, field_names
from commgate.model.schemes import SCHEMES
from commgate.model.trainers import TRAINERS
from commgate.model.transformer import PRESETS


def test_schema_is_a_valid_draft_2020_12_schema_with_an_id() -> None:
    s = schema()
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert s["$id"].startswith("urn:commgate:schema:scenario:")
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["properties"]["schema_version"]["const"] == 1


def test_presets_and_schemes_agree_with_the_registries() -> None:
    props = schema()["properties"]
    assert sorted(props["model"]["properties"]["preset"]["enum"]) == sorted(PRESETS)
    assert props["parallelism"]["properties"]["scheme"]["enum"] == list(SCHEMES)


def test_schema_fields_are_record_fields() -> None:
    props = schema()["properties"]
    par = props["parallelism"]["properties"]
    assert set(par) - {"zero", "moe"} <= set(field_names(Parallelism))
    assert set(par["zero"]["properties"]) == set(field_names(ZeroConfig))
    assert set(par["moe"]["properties"]) == set(field_names(MoEConfig))
    blocks = {name for name, t in TRAINERS.items() if t.options is not None}  # held as Scenario.trainer_options
    assert blocks <= set(props)
    top = set(props) - {"schema_version", "sweep", "sweep_limit", "world_size"} - blocks
    assert top <= set(field_names(Scenario))
