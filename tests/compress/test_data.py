"""Named data sets come from the catalog a caller passes, never from a global registry."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from catalog.data import NAMED
from compress.data import check_data, data_files
from compress.lora import LoraParams


def test_a_name_is_known_only_through_the_catalog_passed_in(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"neither a named data set \(none given\)"):
        check_data("shift", tmp_path)
    assert check_data("shift", tmp_path, NAMED) == "shift"
    assert sorted(data_files("shift", NAMED)) == ["test", "train", "validation"]
    (tmp_path / "mine.txt").write_text("a line of text\n")
    assert check_data("mine.txt", tmp_path) == str(tmp_path / "mine.txt")


def test_step_params_see_the_catalog_in_the_validation_context(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="corpus, shift, shakespeare"):
        LoraParams.model_validate({"data": "shfit"}, context={"data": NAMED})
    with pytest.raises(ValidationError, match="none given"):
        LoraParams.model_validate({"data": "shift"})  # no catalog: only files
    params = LoraParams.model_validate({"data": "shift"}, context={"data": NAMED})
    assert params.data == "shift"
