"""tools/teach.py, the teacher of `make demo TASK=distill`: taught, it answers the colour task's validation images
greedily (the launch's own prompts and pixels); untaught, it does not; either way its config, tokenizer and processor
are the student's, byte for byte."""
import filecmp
import os

import teach


def test_the_taught_teacher_answers_and_the_untaught_one_does_not(tmp_path, tiny_default):
    taught = teach.teach(str(tmp_path / "taught"))
    untaught = teach.teach(str(tmp_path / "untaught"), untaught=True)
    assert taught >= 0.9 and untaught < 0.5, (taught, untaught)
    shared = sorted(f for f in os.listdir(tiny_default[0]) if f != "model.safetensors")
    for folder in ("taught", "untaught"):
        assert sorted(filecmp.cmpfiles(tiny_default[0], tmp_path / folder, shared, shallow=False)[0]) == shared
        assert not filecmp.cmp(os.path.join(tiny_default[0], "model.safetensors"),
                               tmp_path / folder / "model.safetensors", shallow=False)   # new weights
