"""Accelerate's DTensor and `datasets` questions answered without importing either (ddp_accel/lazy_libraries.py).
That a whole run imports neither: tests/test_lazy_compiler.py's run without the compiler."""

import sys
import types

import accelerate.accelerator
import accelerate.data_loader
import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from ddp_accel import lazy_libraries

pytestmark = pytest.mark.inprocess


def test_a_library_never_imported_is_no_answer_and_once_imported_accelerate_answers(monkeypatch):
    asked = []

    def answer(value):
        asked.append(value)
        return value == "yes"

    deferred = lazy_libraries._no_until_imported("a_library_of_the_test", answer)
    monkeypatch.setitem(sys.modules, "a_library_of_the_test", None)  # never imported: an import would raise
    assert deferred("yes") is False and asked == []
    monkeypatch.setitem(sys.modules, "a_library_of_the_test", object())
    assert deferred("yes") is True and deferred("no") is False and asked == ["yes", "no"]


QUESTION_ASKED = """
def is_lib_available():
    return True

def prepare(dataset):
    return is_lib_available()

class State:
    def split(self, values):
        def each(value):
            return is_lib_available()
        return [each(value) for value in values]
"""


def test_only_a_function_asked_where_the_question_is_known_is_changed(monkeypatch):
    owner = types.ModuleType("accelerate_of_the_test")
    exec(QUESTION_ASKED, vars(owner))  # its functions' __module__: the module's name
    assert lazy_libraries.callers(owner, "is_lib_available") == {"prepare", "State.split"}
    monkeypatch.setitem(sys.modules, "a_library", None)
    assert lazy_libraries.defer_library_imports([(owner, "is_lib_available", "a_library", {"prepare"})]) == 0
    assert owner.prepare(None) is True  # asked elsewhere too (State.split): Accelerate's own function kept
    known = {"prepare", "State.split"}
    assert lazy_libraries.defer_library_imports([(owner, "is_lib_available", "a_library", known)]) == 1
    assert owner.prepare(None) is False and owner.State().split([1]) == [False]


def test_accelerate_prepares_a_model_and_a_loader_of_two_ranks_without_either_import(monkeypatch):
    lazy_libraries.defer_library_imports()
    assert lazy_libraries.defer_library_imports() == 0  # idempotent
    for module in [lazy_libraries.DTENSOR, lazy_libraries.DATASETS]:
        monkeypatch.setitem(sys.modules, module, None)  # as if never imported: an import raises ImportError
    assert accelerate.accelerator.model_has_dtensor(torch.nn.Linear(2, 2)) is False
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=1, put_on_device=False)
    assert [batch.tolist() for batch in prepared] == [[2, 3], [6, 7]]  # rank 1's batches, as without the change


def test_once_datasets_is_imported_its_iterable_datasets_are_sharded_by_accelerate():
    datasets = pytest.importorskip("datasets")
    lazy_libraries.defer_library_imports()
    assert accelerate.data_loader.is_datasets_available() is True
    shards = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=2)
    loader = torch.utils.data.DataLoader(shards, batch_size=2)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=1, put_on_device=False)
    assert [batch["x"].tolist() for batch in prepared] == [[4, 5], [6, 7]]  # the second shard: Accelerate's answer
