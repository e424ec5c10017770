"""config.json / preprocessor settings read as transformers reads them, on configs shaped like the released ones."""
import copy
import json

import pytest

from qwen35_fast.runtime.config import from_hf_dict
from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.media import Preprocessing, read_preprocessing

# the released sizes' text settings (hidden, layers, intermediate, heads, kv heads, GDN value heads, tied)
SIZES = {"0.8B": (1024, 24, 3584, 8, 2, 16, True), "2B": (2048, 24, 6144, 8, 2, 16, True),
         "4B": (2560, 32, 9216, 16, 4, 32, True), "9B": (4096, 32, 12288, 16, 4, 32, False),
         "27B": (5120, 64, 17408, 24, 4, 48, False)}


def released(size: str) -> dict:
    """A config.json laid out as Qwen's (text_config with rope_parameters, eos as an int, tie at both levels)."""
    hidden, layers, inter, heads, kv, hv, tie = SIZES[size]
    text = {"model_type": "qwen3_5_text", "attn_output_gate": True, "eos_token_id": 248044, "full_attention_interval": 4,
            "head_dim": 256, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": hv, "max_position_embeddings": 262144, "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-6, "vocab_size": 248320, "tie_word_embeddings": tie,
            "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                                "rope_theta": 10000000, "rope_type": "default"}}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": tie}


@pytest.mark.parametrize("size", list(SIZES))
def test_a_config_without_head_dim_gets_transformers_default(size):
    """head_dim is 256 in every Qwen3.5; transformers' Qwen3_5TextConfig defaults it to 256. hidden / heads is not
    it for the 0.8B (128), 4B (160) or 27B (213), whose weights would then be refused as not fitting the config."""
    from transformers import Qwen3_5Config
    cfg = released(size)
    del cfg["text_config"]["head_dim"]
    theirs = Qwen3_5Config(**copy.deepcopy(cfg)).text_config.head_dim
    assert from_hf_dict(cfg).head_dim == theirs == 256


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144},
    {"rope_type": "linear", "factor": 2.0},
    {"type": "dynamic", "factor": 2.0},
])
def test_a_scaled_rotary_is_refused_not_read_as_the_plain_one(rope):
    """A config edited for long context as the model card describes (rope_type yarn, factor 4): transformers computes
    other frequencies and scales cos / sin by 1.14 at every length; reading it as plain rotary would answer as
    another model, silently. It is refused with the way back."""
    cfg = released("9B")
    cfg["text_config"]["rope_parameters"].pop("rope_type")
    cfg["text_config"]["rope_parameters"].update(rope)
    with pytest.raises(Qwen35Error, match=r"config.json: rope_type is '(yarn|linear|dynamic)'.*Set rope_type to "
                                          r"\"default\""):
        from_hf_dict(cfg)
    legacy = released("9B")  # the older name of the same dict, rope_theta beside it
    old = legacy["text_config"].pop("rope_parameters")
    legacy["text_config"]["rope_theta"] = old.pop("rope_theta")
    old.pop("rope_type")
    legacy["text_config"]["rope_scaling"] = {**old, **rope}
    with pytest.raises(Qwen35Error, match="rope_type is"):
        from_hf_dict(legacy)


def test_the_plain_rotary_loads_under_every_name_it_has():
    cfg = released("4B")
    assert from_hf_dict(copy.deepcopy(cfg)).rope_theta == 1e7
    cfg["text_config"]["rope_parameters"].pop("rope_type")
    assert from_hf_dict(copy.deepcopy(cfg)).rope_theta == 1e7
    cfg["text_config"]["rope_parameters"]["type"] = "mrope"  # Qwen2-VL's legacy name for it
    assert from_hf_dict(cfg).mrope_section == (11, 11, 10)


def test_processor_config_json_of_transformers_5_is_read(tmp_path):
    """transformers 5 saves a processor as one processor_config.json with the image and video processors nested, and
    reads that before preprocessor_config.json / video_preprocessor_config.json: a fine-tune saved so keeps its
    pixel budget."""
    (tmp_path / "processor_config.json").write_text(json.dumps({
        "processor_class": "Qwen3VLProcessor",
        "image_processor": {"size": {"longest_edge": 1_000_000, "shortest_edge": 4096}, "patch_size": 16,
                            "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
        "video_processor": {"size": {"longest_edge": 2_000_000, "shortest_edge": 8192}, "fps": 1,
                            "max_frames": 64}}))
    pp = read_preprocessing(tmp_path)
    assert (pp.min_pixels, pp.max_pixels, pp.video_min_pixels, pp.video_max_pixels) == (4096, 1_000_000, 8192,
                                                                                        2_000_000)
    assert (pp.fps, pp.max_frames) == (1, 64)
    # the nested one wins over the older files, as in transformers
    (tmp_path / "preprocessor_config.json").write_text('{"size": {"longest_edge": 5000000, "shortest_edge": 1024}}')
    assert read_preprocessing(tmp_path).max_pixels == 1_000_000
    # a processor_config.json without nested processors (transformers 4's) leaves the older files in charge
    (tmp_path / "processor_config.json").write_text('{"processor_class": "Qwen3VLProcessor"}')
    pp = read_preprocessing(tmp_path)
    assert (pp.max_pixels, pp.video_max_pixels) == (5_000_000, Preprocessing().video_max_pixels)


def test_null_min_max_pixels_leave_size_in_charge(tmp_path):
    """"min_pixels": null / "max_pixels": null beside size: transformers' Qwen2VLImageProcessor keeps size."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": None, "max_pixels": None, "size": {"longest_edge": 1_000_000, "shortest_edge": 4096}}))
    pp = read_preprocessing(tmp_path)
    assert (pp.min_pixels, pp.max_pixels) == (4096, 1_000_000)


def test_a_config_without_rope_theta_takes_transformers_default():
    """A config.json naming no rope_theta anywhere: transformers' rope mixin gives 10,000 (the 1e7 of every released
    Qwen3.5 is only for single files, which have no config)."""
    from transformers import Qwen3_5Config
    cfg = released("9B")
    del cfg["text_config"]["rope_parameters"]["rope_theta"]
    theirs = Qwen3_5Config(**copy.deepcopy(cfg)).text_config.rope_parameters["rope_theta"]
    assert from_hf_dict(cfg).rope_theta == theirs == 10_000.0


def test_min_max_pixels_beside_size_count_for_images_and_not_for_video(tmp_path):
    """The image processor lets min_pixels / max_pixels override size; Qwen3-VL's video processor reads size alone
    (its resize takes size's two edges): stale keys beside a video config's size change nothing there."""
    stale = {"min_pixels": 1024, "max_pixels": 1_000_000, "size": {"shortest_edge": 4096, "longest_edge": 25_165_824}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(stale))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(stale))
    pp = read_preprocessing(tmp_path)
    assert (pp.min_pixels, pp.max_pixels) == (1024, 1_000_000)
    assert (pp.video_min_pixels, pp.video_max_pixels) == (4096, 25_165_824)
    # nor without size: the video limits stay the defaults
    (tmp_path / "video_preprocessor_config.json").write_text('{"min_pixels": 2048, "max_pixels": 3000000}')
    pp = read_preprocessing(tmp_path)
    assert (pp.video_min_pixels, pp.video_max_pixels) == (Preprocessing().video_min_pixels,
                                                          Preprocessing().video_max_pixels)


@pytest.mark.parametrize("vision", [
    {"rope_theta": 5000.0},
    {"rope_theta": 5000.0, "rope_parameters": {"rope_type": "axial", "rope_theta": 7.0}},
    {"num_attention_heads": 12, "num_hidden_layers": 5},
    {"num_heads": 8, "num_attention_heads": 12, "depth": 8, "num_hidden_layers": 12},
], ids=["theta-beside", "theta-both", "aliases", "both-names"])
def test_the_vision_config_reads_what_transformers_reads(vision):
    """transformers' Qwen3_5VisionConfig takes an older config's rope_theta beside the sizes (where rope_parameters
    has none) and num_attention_heads / num_hidden_layers for num_heads / depth (the alias wins where both are
    given): the tower reads the same, where it took 10,000 and a missing-key error."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    from qwen35_fast.runtime.vision import vision_config_from_hf
    base = {"hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096}
    if not {"num_heads", "num_attention_heads"} & set(vision):
        base |= {"num_heads": 16, "depth": 27}
    v = base | vision
    theirs = Qwen3_5VisionConfig.from_dict(copy.deepcopy(v))
    ours = vision_config_from_hf({"vision_config": v})
    assert (ours.num_heads, ours.depth, ours.rope_theta) == (theirs.num_heads, theirs.depth,
                                                              theirs.rope_parameters["rope_theta"])


@pytest.mark.parametrize("name, content, message", [
    ("preprocessor_config.json", b'{"size": {"longest_edge": 1000000, "shortest_edge": 4096, "x": "caf\xe9"}}',
     "not UTF-8 text"),
    ("preprocessor_config.json", b"[" * 100_000, "not valid JSON"),
    ("preprocessor_config.json", '{"size": [4096, 1000000]}', r"size is \[4096, 1000000\], not an object"),
    ("preprocessor_config.json", '{"min_pixels": "lots"}', "min_pixels is 'lots', which is not a whole number"),
    ("preprocessor_config.json", '{"max_pixels": 0}', "max_pixels is 0, which is not a whole number above 0"),
    ("preprocessor_config.json", '{"size": {"shortest_edge": 0, "longest_edge": 0}}', "size.shortest_edge is 0"),
    ("preprocessor_config.json", '{"merge_size": 0}', "merge_size is 0"),
    ("preprocessor_config.json", '{"patch_size": 16.5}', "patch_size is 16.5"),
    ("preprocessor_config.json", '{"image_mean": [0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}', "image_mean is"),
    ("preprocessor_config.json", '{"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0, 0.5]}',
     "image_std is .* three non-zero numbers"),
    ("video_preprocessor_config.json", '{"max_frames": 0}', "max_frames is 0"),
    ("video_preprocessor_config.json", '{"min_frames": 8, "max_frames": 4}', "min_frames 8 is above max_frames 4"),
    ("video_preprocessor_config.json", '{"size": {"shortest_edge": 4096, "longest_edge": 0}}',
     "size.longest_edge is 0"),
    ("video_preprocessor_config.json", '{"fps": "2"}', "fps is '2', which is not a number above 0"),
    ("video_preprocessor_config.json", '{"fps": 0}', "fps is 0"),
    ("video_preprocessor_config.json", '{"cap_pixels_per_frame": "yes"}', "cap_pixels_per_frame is 'yes'"),
])
def test_a_processor_file_the_processor_could_not_use_is_named_with_its_key(tmp_path, name, content, message):
    """A checkpoint's processor files are read before any image: a value no processor could use (a pixel budget
    of 0, text for a number, a size given as a list, bytes that are not UTF-8) raised ZeroDivisionError,
    IndexError, TypeError or UnicodeDecodeError from deep in the resize or the frame sampling; now a Qwen35Error
    names the file, the key and the value."""
    (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(Qwen35Error, match=message) as e:
        read_preprocessing(tmp_path)
    assert name in str(e.value)


def test_processor_file_numbers_as_json_writes_them_are_taken(tmp_path):
    """Counts written as 2.0, an fps of 1, one image_mean / image_std for every channel (transformers takes a
    number there too): read as the processor reads them."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 4096.0, "longest_edge": 1e6}, "merge_size": 2.0, "image_mean": 0.5,
        "image_std": [0.25, 0.5, 1]}))
    (tmp_path / "video_preprocessor_config.json").write_text('{"fps": 1, "max_frames": 64.0, "min_frames": 2}')
    pp = read_preprocessing(tmp_path)
    assert (pp.min_pixels, pp.max_pixels, pp.merge_size) == (4096, 1_000_000, 2)
    assert type(pp.max_pixels) is int and type(pp.merge_size) is int
    assert pp.mean == (0.5, 0.5, 0.5) and pp.std == (0.25, 0.5, 1.0)
    assert (pp.fps, pp.max_frames, pp.min_frames) == (1.0, 64, 2)
