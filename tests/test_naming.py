"""The generated names and the `"name:value"` attr encoding, built and parsed in one place."""

from __future__ import annotations

import pytest

from transpiler import naming
from transpiler.naming import MalformedEntryError


def test_names_match_paddles():
    assert naming.block_name("fc_w@GRAD", 1) == "fc_w@GRAD.block1"
    assert naming.trainer_name("fc_w@GRAD.block1", 0) == "fc_w@GRAD.block1.trainer_0"
    assert naming.shard_name("emb@GRAD.trainer_1", 0) == "emb@GRAD.trainer_1.pserver_0"
    assert [naming.trainer_of(n) for n in ("w@GRAD.block1.trainer_2", "emb@GRAD.trainer_1.pserver_0", "w@GRAD", "a.trainer_x")] == [2, 1, None, None]
    assert naming.control_var(3) == "__control_var@3"
    assert (naming.prefetch_in(1), naming.prefetch_out(1)) == ("prefetch_compress_in_tmp_1", "prefetch_compress_out_tmp_1")
    assert naming.LOOKUP_TABLE_PATH == "kLookupTablePath"


def test_pairs_round_trip_and_names_may_hold_colons():
    entries = naming.encode_pairs([("fc_w@GRAD.block1", 3), ("a:b", 4)])
    assert entries == ["fc_w@GRAD.block1:3", "a:b:4"]
    assert naming.decode_block_ids(entries, "grad_to_block_id") == {"fc_w@GRAD.block1": 3, "a:b": 4}
    assert naming.decode_pair("g:w.block0", "sparse_grad_to_param") == ("g", "w.block0")


@pytest.mark.parametrize("entry", ["no_colon", ":3", "g:", "g:x"])
def test_a_malformed_block_id_entry_is_named(entry):
    with pytest.raises(MalformedEntryError, match=f"malformed grad_to_block_id entry '{entry}'"):
        naming.decode_block_id(entry, "grad_to_block_id")


def test_the_naming_module_is_a_leaf():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(naming.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "collections.abc", "transpiler.errors"}


def test_the_pserver_runtime_names_a_malformed_entry_and_its_endpoint():
    from ops.kernels.context import KernelError
    from ops.rpc.listen_and_serv import parse_grad_to_block

    assert parse_grad_to_block(["a:b:2"], "ep") == {"a:b": 2}
    with pytest.raises(KernelError, match="listen_and_serv on ep: malformed prefetch_var_name_to_block_id entry 'x:y'"):
        parse_grad_to_block(["x:y"], "ep", "prefetch_var_name_to_block_id")
