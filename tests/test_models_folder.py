"""The loader's model list (nodes/models_folder.py) over the folders ComfyUI users have: models/LLM (one or more,
from extra_model_paths.yaml) holding checkpoint folders, nested folders and single files, and models/text_encoders.
Needs ComfyUI (COMFYUI_DIR); skipped otherwise. Each test lists its own folders, made here."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import json
import os
import shutil
from pathlib import Path

import pytest
from test_nodes import checkpoint_for_tests, comfy, pack  # noqa: F401  (fixtures)

pytestmark = pytest.mark.comfyui

QWEN = json.dumps({"model_type": "qwen3_5"})


@pytest.fixture
def folders(comfy, pack, tmp_path, monkeypatch):
    """Two models/LLM folders (the first the default one) and a models/text_encoders folder, empty, as the only
    ones ComfyUI knows; single-file verdicts start afresh."""
    fp = comfy.folder_paths
    llm, extra, te = tmp_path / "LLM", tmp_path / "extra_LLM", tmp_path / "text_encoders"
    for folder in (llm, extra, te):
        folder.mkdir()
    monkeypatch.setattr(fp, "models_dir", str(tmp_path))  # models/LLM is `llm`
    monkeypatch.setitem(fp.folder_names_and_paths, "LLM", ([str(llm), str(extra)], set()))
    monkeypatch.setitem(fp.folder_names_and_paths, "text_encoders", ([str(te)], {".safetensors"}))
    monkeypatch.setattr(fp, "filename_list_cache", {})
    monkeypatch.setattr(pack.models_folder, "_header_verdicts", {})
    return type("Folders", (), {"llm": llm, "extra": extra, "te": te})


def _checkpoint_folder(path: Path, config: str = QWEN) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(config)
    return path


def _qwen_file(path: Path) -> Path:
    """A single-file Qwen3.5 checkpoint (the demo's weights)."""
    weights = sorted(checkpoint_for_tests().glob("*.safetensors"))
    if len(weights) != 1:
        pytest.skip("the test checkpoint has more than one weight file")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(weights[0], path)
    return path


def _listed(pack):
    return pack.Qwen35ModelLoader.INPUT_TYPES()["required"]["model"][1]["options"]


def test_models_llm_is_listed_beside_an_extra_model_paths_llm_key(pack, comfy, folders, monkeypatch):
    """extra_model_paths.yaml with an `LLM:` key registers the name before the pack loads: models/LLM is listed
    after the yaml's folder all the same (it was left out, and its checkpoints with it)."""
    fp = comfy.folder_paths
    monkeypatch.setitem(fp.folder_names_and_paths, "LLM", ([str(folders.extra)], set()))  # as the yaml leaves it
    _checkpoint_folder(folders.llm / "Qwen3.5-in-models")
    _checkpoint_folder(folders.extra / "Qwen3.5-in-extra")
    assert _listed(pack) == ["Qwen3.5-in-extra", "Qwen3.5-in-models"]
    assert fp.get_folder_paths("LLM") == [str(folders.extra), str(folders.llm)]
    assert pack.models_folder.find_model("Qwen3.5-in-models") == folders.llm / "Qwen3.5-in-models"
    pack.models_folder.ensure_llm_folder()  # once more: listed once
    assert fp.get_folder_paths("LLM") == [str(folders.extra), str(folders.llm)]


def test_llm_is_registered_where_models_cannot_hold_it(pack, comfy, tmp_path, monkeypatch):
    """A models folder where models/LLM cannot be made (read-only; here a file) still gets the name registered:
    listing and loading by name do not fail on a missing key."""
    fp = comfy.folder_paths
    monkeypatch.setattr(fp, "folder_names_and_paths", {k: v for k, v in fp.folder_names_and_paths.items()
                                                       if k != "LLM"})
    (tmp_path / "models").write_text("")  # makedirs of models/LLM fails (NotADirectoryError)
    monkeypatch.setattr(fp, "models_dir", str(tmp_path / "models"))
    pack.models_folder.ensure_llm_folder()
    assert fp.get_folder_paths("LLM") == [str(tmp_path / "models" / "LLM")]


def test_hidden_folders_are_not_listed(pack, folders):
    """A download tool's .cache or a .trash holding a checkpoint is not offered as a model."""
    _checkpoint_folder(folders.llm / "Qwen3.5-4B")
    _checkpoint_folder(folders.llm / ".cache" / "Qwen3.5-4B")
    _checkpoint_folder(folders.llm / ".trash")
    assert _listed(pack) == ["Qwen3.5-4B"]


def test_an_unreadable_folder_is_not_listed(pack, folders, monkeypatch):
    """lost+found (or a folder without permission) in models/LLM: left out, the rest listed."""
    _checkpoint_folder(folders.llm / "Qwen3.5-4B")
    (folders.llm / "lost+found").mkdir()
    real_iterdir, real_scandir = Path.iterdir, os.scandir

    def iterdir(self):  # root ignores chmod 000, so the permission error is made here
        if self.name == "lost+found":
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    def scandir(path="."):
        if str(path).endswith("lost+found"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    monkeypatch.setattr(os, "scandir", scandir)
    assert _listed(pack) == ["Qwen3.5-4B"]


def test_nested_folders_are_listed_down_to_the_depth_limit(pack, folders):
    """Checkpoints kept by organisation (models/LLM/Qwen/Qwen3.5-4B) are listed by their relative path, down to
    3 levels; deeper folders (a linked disk of datasets) are not searched."""
    _checkpoint_folder(folders.llm / "Qwen" / "Qwen3.5-4B")
    _checkpoint_folder(folders.llm / "a" / "b" / "Qwen3.5-2B")
    _checkpoint_folder(folders.llm / "a" / "b" / "c" / "Qwen3.5-9B")
    assert _listed(pack) == ["a/b/Qwen3.5-2B", "Qwen/Qwen3.5-4B"]


def test_the_first_llm_folder_wins_a_name_clash(pack, folders):
    """The same name in two models/LLM folders: the listed name loads the one in the first folder."""
    first = _checkpoint_folder(folders.llm / "Qwen3.5-4B")
    _checkpoint_folder(folders.extra / "Qwen3.5-4B")
    _checkpoint_folder(folders.extra / "Qwen3.5-2B")
    models = pack.models_folder.available_models()
    assert list(models) == ["Qwen3.5-4B", "Qwen3.5-2B"] and models["Qwen3.5-4B"] == first
    assert pack.models_folder.find_model("Qwen3.5-4B") == first


def test_an_llm_file_wins_over_a_text_encoders_file_of_the_same_name(pack, folders):
    """qwen.safetensors in both models/LLM and models/text_encoders: listed once, the one in models/LLM."""
    in_llm = _qwen_file(folders.llm / "qwen.safetensors")
    _qwen_file(folders.te / "qwen.safetensors")
    _qwen_file(folders.te / "other_qwen.safetensors")
    models = pack.models_folder.available_models()
    assert models == {"qwen.safetensors": in_llm, "other_qwen.safetensors": folders.te / "other_qwen.safetensors"}
    assert pack.models_folder.find_model("qwen.safetensors") == in_llm


def test_single_files_in_a_folder_without_config_are_listed_by_their_path_and_load(pack, folders):
    """A folder without config.json holding Qwen3.5 single files (kept together by a user) lists each file by its
    path, and the listed name loads; a folder of a checkpoint's shards without its config.json is listed as the
    folder (loading it names what is missing); an empty folder is not listed."""
    _qwen_file(folders.llm / "qwen" / "a_2b.safetensors")
    _qwen_file(folders.llm / "qwen" / "deeper" / "b_4b.safetensors")
    _qwen_file(folders.llm / "shards" / "model-00001-of-00002.safetensors")
    (folders.llm / "empty").mkdir()
    assert _listed(pack) == ["qwen/a_2b.safetensors", "qwen/deeper/b_4b.safetensors", "shards"]
    model = pack.Qwen35ModelLoader.execute(model="qwen/deeper/b_4b.safetensors", dtype="fp32", device="cpu",
                                           backend="torch", keep_loaded=False)[0]
    model.release()
    from qwen35_fast.runtime import Qwen35Error
    with pytest.raises(Qwen35Error, match=r"shards: no config\.json"):
        pack.Qwen35ModelLoader.execute(model="shards", dtype="fp32", device="cpu", backend="torch",
                                       keep_loaded=False)


def test_a_folder_with_a_damaged_config_is_listed_and_loading_it_names_the_problem(pack, folders):
    """A checkpoint folder whose config.json is cut short (an interrupted download) stays in the list, so that
    picking it says which file to fetch again, rather than the model silently missing."""
    _checkpoint_folder(folders.llm / "Qwen3.5-4B", '{"model_type": "qwen3_5",')
    assert _listed(pack) == ["Qwen3.5-4B"]
    from qwen35_fast.runtime import Qwen35Error
    with pytest.raises(Qwen35Error, match=r"Qwen3\.5-4B.config\.json: not valid JSON .*re-download it"):
        pack.Qwen35ModelLoader.execute(model="Qwen3.5-4B", dtype="auto", device="cpu", backend="auto",
                                       keep_loaded=False)
    # one without model_type (hand-written, or cut by an editor): listed too, and loading it says what it lacks
    _checkpoint_folder(folders.llm / "Qwen3.5-2B", '{"architectures": ["Qwen3_5ForConditionalGeneration"]}')
    assert _listed(pack) == ["Qwen3.5-2B", "Qwen3.5-4B"]
    with pytest.raises(Qwen35Error, match=r"Qwen3\.5-2B.*model_type"):
        pack.Qwen35ModelLoader.execute(model="Qwen3.5-2B", dtype="auto", device="cpu", backend="auto",
                                       keep_loaded=False)


def test_a_file_replaced_on_disk_is_judged_again(pack, folders):
    """A single file that was another model's, replaced by a Qwen3.5 one (same name): listed on the next refresh,
    and left out again once replaced back."""
    import torch
    from safetensors.torch import save_file
    path = folders.llm / "model.safetensors"

    def other_model():
        save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(2, 2)}, str(path))
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    other_model()
    assert _listed(pack) == []
    _qwen_file(path)
    assert _listed(pack) == ["model.safetensors"]
    other_model()
    assert _listed(pack) == []


def test_the_list_is_sorted_regardless_of_case(pack, folders):
    """The dropdown is in alphabetical order whatever the capitals: qwen-small next to Qwen-Big, not after every
    capitalised name."""
    for name in ("qwen-small", "Qwen-Big", "alpha", "Zeta"):
        _checkpoint_folder(folders.llm / name)
    assert _listed(pack) == ["alpha", "Qwen-Big", "qwen-small", "Zeta"]


def test_a_file_whose_suffix_is_in_capitals_is_listed_and_loads(pack, folders):
    """ComfyUI lists text_encoders/X.SAFETENSORS (it compares suffixes case-blind, as Windows does): the loader
    listed it nowhere, and the runtime refused it as pickle weights to convert to safetensors."""
    _qwen_file(folders.te / "Qwen3.5.SAFETENSORS")
    _qwen_file(folders.llm / "mine" / "qwen3.5_tiny.SafeTensors")
    assert _listed(pack) == ["mine/qwen3.5_tiny.SafeTensors", "Qwen3.5.SAFETENSORS"]
    for name in _listed(pack):
        model = pack.Qwen35ModelLoader.execute(model=name, dtype="fp32", device="cpu", backend="torch",
                                               keep_loaded=False)[0]
        model.release()
