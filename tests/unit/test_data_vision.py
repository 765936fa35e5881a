"""The digits data set and the image batch sampler (rtxmpi.data_vision): a seeded split, and a
global batch that is a function of (seed, sample index) only, the same at any world size."""
import sys

import numpy as np
import pytest

from rtxmpi.data_vision import ImageBatchSampler, eval_slice, load_digits
from rtxmpi.errors import ConfigError


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_digits_are_8x8_one_channel_images_in_0_1_with_10_classes(digits):
    assert digits.train_images.shape[1:] == (8, 8, 1) and digits.train_images.dtype == np.float32
    assert len(digits.train_labels) + len(digits.val_labels) == 1797
    assert len(digits.val_labels) == round(0.2 * 1797)
    both = np.concatenate([digits.train_images, digits.val_images])
    assert both.min() == 0.0 and both.max() == 1.0
    assert set(digits.train_labels.tolist()) == set(range(10)) == set(digits.val_labels.tolist())
    assert digits.n_classes == 10


def test_split_is_seeded_disjoint_and_covers_every_image(digits):
    again, other = load_digits(seed=0), load_digits(seed=1)
    np.testing.assert_array_equal(again.val_images, digits.val_images)
    assert not np.array_equal(other.val_images, digits.val_images)
    rows = {img.tobytes() + bytes([lab]) for img, lab in
            zip(np.concatenate([digits.train_images, digits.val_images]),
                np.concatenate([digits.train_labels, digits.val_labels]))}
    # the digits hold a few exact duplicates; the split loses or repeats none of the 1797 rows
    from sklearn.datasets import load_digits as sklearn_digits
    raw = sklearn_digits()
    expected = {(img / 16.0).astype(np.float32)[..., None].tobytes() + bytes([lab])
                for img, lab in zip(raw.images, raw.target)}
    assert rows == expected


@pytest.mark.parametrize("val_fraction", [0, 1, -0.1, 1.5, True, "0.2"])
def test_bad_val_fraction_raises_config_error(val_fraction):
    with pytest.raises(ConfigError, match="val_fraction"):
        load_digits(val_fraction)


def test_missing_scikit_learn_raises_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    with pytest.raises(ConfigError, match=r"rtxmpi\[vision\]"):
        load_digits()


def sampler_images(n=23):
    images = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)
    return images, np.arange(n, dtype=np.int64) % 10


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_ranks_slices_concatenate_to_the_one_process_global_batch(dp_size):
    images, labels = sampler_images()
    one = ImageBatchSampler(images, labels, 8, seed=4)
    ranks = [ImageBatchSampler(images, labels, 8, seed=4, dp_rank=r, dp_size=dp_size)
             for r in range(dp_size)]
    for _ in range(7):  # crosses epochs (23 images, 8 per step)
        x, y = one.next_batch()
        parts = [s.next_batch() for s in ranks]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
        np.testing.assert_array_equal(y, x.reshape(-1).astype(np.int64) % 10)  # pairs kept


def test_every_epoch_visits_each_image_once_in_its_own_order():
    images, labels = sampler_images()
    sampler = ImageBatchSampler(images, labels, 23, seed=1)
    first, second = (sampler.next_batch()[0].reshape(-1).astype(int) for _ in range(2))
    assert sorted(first) == sorted(second) == list(range(23))
    assert not np.array_equal(first, second) and sampler.epoch == 2


def test_resume_from_state_dict_reads_the_same_batches_at_another_world_size():
    images, labels = sampler_images()
    run = ImageBatchSampler(images, labels, 6, seed=9)
    for _ in range(3):
        run.next_batch()
    state = run.state_dict()
    expected = [run.next_batch()[0] for _ in range(3)]
    resumed = [ImageBatchSampler(images, labels, 6, dp_rank=r, dp_size=2) for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)
    for want in expected:
        np.testing.assert_array_equal(np.concatenate([s.next_batch()[0] for s in resumed]), want)


def test_uneven_split_gives_the_first_ranks_one_more_sample():
    images, labels = sampler_images()
    sizes = [len(ImageBatchSampler(images, labels, 8, dp_rank=r, dp_size=3).next_batch()[1])
             for r in range(3)]
    assert sizes == [3, 3, 2]


@pytest.mark.parametrize("kwargs, match", [
    ({"global_batch": 1, "dp_size": 2}, "smaller than the data-parallel size"),
    ({"dp_rank": 2, "dp_size": 2}, "outside"),
    ({"seed": -1}, "seed must be an integer"),
    ({"global_batch": 2.5}, "global_batch must be an integer"),
    ({"labels": np.zeros(3, np.int64)}, "does not match"),
    ({"images": np.zeros((0, 1, 1, 1)), "labels": np.zeros(0)}, "no images"),
])
def test_bad_sampler_arguments_raise_config_error(kwargs, match):
    images, labels = sampler_images()
    args = {"images": images, "labels": labels, "global_batch": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        ImageBatchSampler(args.pop("images"), args.pop("labels"), args.pop("global_batch"),
                          **args)


def test_bad_sampler_state_raises_config_error():
    images, labels = sampler_images()
    with pytest.raises(ConfigError, match="samples_consumed"):
        ImageBatchSampler(images, labels, 4).load_state_dict({"seed": 0})


def test_eval_slices_cover_the_held_out_set_once():
    for dp_size in (1, 2, 3, 4):
        parts = [eval_slice(359, r, dp_size) for r in range(dp_size)]
        assert [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]]
        assert (parts[0].start, parts[-1].stop) == (0, 359)
    with pytest.raises(ConfigError, match="smaller than the data-parallel size"):
        eval_slice(1, 0, 2)
