"""decide_partition on real Lance tables: the findings of issue 10 ("correct on real data").

Each test reproduces one way the skip policy failed open (a sample it knew nothing about,
or had excluded for a reason, still reached training; or a whole cluster was lost) and
asserts the fail-closed decision instead.
"""

import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.skip_decisions import decide_partition
from prx_assets.core.skip_policy import SkipPolicy
from prx_assets_tests.core.skip_world import FLAT, World, key_of

A, B, C = "src.a", "src.b", "src.c"


@pytest.fixture
def world(tmp_path) -> World:
    return World(Lab(tmp_path / "lab"))


def _reasons(world: World, batch: str, policy: SkipPolicy | None = None) -> dict[str, tuple]:
    """Image name -> reasons, for every written sample of ``batch``."""
    out = decide_partition(world.lab, batch, world.samples(batch), policy or SkipPolicy())
    names = {key_of(n): n for n in world.images}
    return {names[d.sample.key]: d.reasons for d in out.decisions}


def _kept(world: World) -> set[str]:
    return {n for b in world.batches() for n, r in _reasons(world, b).items() if not r}


def test_low_information_images_are_excluded_by_default(world):
    world.image("blank", A, ac_energy=FLAT)
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {"blank": ("low_information",), "photo": ()}


def test_a_sample_without_a_class_label_is_pending(world):
    world.image("unlabelled", A, label=None)
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {"unlabelled": ("pending",), "photo": ()}


def test_a_sample_without_a_dedup_decision_is_pending(world):
    world.image("unhashed", A, hashed=False)  # no image_hashes row, so no phash_clusters row
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {"unhashed": ("pending",), "photo": ()}


@pytest.mark.parametrize("caption", [None, "", "  \n\t "])
def test_an_image_without_a_usable_caption_is_excluded_as_no_caption(world, caption):
    world.image("no-alt", A, caption=caption)
    world.image("no-row", A, has_caption_row=False, label=None)
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {
        "no-alt": ("no_caption",),
        "no-row": ("no_caption",),
        "photo": (),
    }


def test_an_excluded_keeper_hands_training_to_the_best_remaining_copy(world):
    # A 10-member cluster over three batches; the keeper (most pixels) is classified nsfw.
    world.image("keeper", A, phash=7, pixels=2000 * 600, label="nsfw")
    for i in range(9):
        world.image(f"copy{i}", (A, B, C)[i % 3], phash=7, pixels=(1000 + 10 * i) * 600)
    world.commit()
    # The best remaining copy is copy8 (most pixels after the keeper), in batch C.
    assert _kept(world) == {"copy8"}
    assert _reasons(world, A)["keeper"] == ("class_nsfw", "duplicate")


def test_an_opt_out_of_a_smaller_copy_excludes_the_larger_copy(world):
    world.image("original", A, phash=9, pixels=1600 * 600)
    small = world.image("small-copy", B, phash=9, pixels=800 * 600)
    world.image("unrelated", A)
    world.commit()
    world.opt_out("legal.txt@1", [small])
    assert _reasons(world, A) == {"original": ("opt_out",), "unrelated": ()}
    assert _reasons(world, B) == {"small-copy": ("opt_out",)}
