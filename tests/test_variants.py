"""The config objects of the sparse hooks' variants: a setting can be written only with the
variant it belongs to, and a bad one raises when the object is made."""

import pickle

import pytest

from hetero_comm.hooks import DCT, AutoDensity, SegmentSparseState, TwoLevelState


@pytest.mark.parametrize("make, pattern", [
    (lambda: DCT(block_size=48), "DCT block_size must be a power of two"),
    (lambda: DCT(block_size=1), r"block_size must be an integer in \[2, 4096\]"),
    (lambda: DCT(block_size=8192), r"block_size must be an integer in \[2, 4096\]"),
    (lambda: AutoDensity(floor=0.5, ceiling=0.1), r"AutoDensity floor \(0.5\) is above its ceiling"),
    (lambda: AutoDensity(floor=0.0), r"AutoDensity floor must be a number in \(0.0, 1.0\]"),
    (lambda: AutoDensity(ceiling=1.5), r"AutoDensity ceiling must be a number in \(0.0, 1.0\]"),
    (lambda: SegmentSparseState(basis="fourier"), "basis must be 'elements', 'dct' or a DCT"),
    (lambda: SegmentSparseState(density=AutoDensity()), "an automatic density needs the two-level"),
    (lambda: SegmentSparseState(density="auto"), "an automatic density needs the two-level"),
])
def test_bad_variant_settings_raise_naming_the_setting(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@pytest.mark.parametrize("sparse_setting", [dict(density=0.1), dict(momentum=0.9),
                                            dict(basis=DCT()), dict(output="sign")])
def test_dense_two_level_takes_no_setting_of_the_sparse_exchange(sparse_setting):
    """Checked by its signature, before any process group is needed."""
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        TwoLevelState.dense(machines=1, **sparse_setting)


@pytest.mark.parametrize("basis, setting, block", [
    ("elements", "elements", 64), ("dct", DCT(64), 64), (DCT(block_size=16), DCT(16), 16)])
def test_basis_is_kept_as_plain_values_and_reported_as_given(basis, setting, block):
    state = SegmentSparseState(basis=basis)
    assert state.basis_setting() == setting and state.settings()["basis"] == setting
    assert state.basis == ("elements" if setting == "elements" else "dct")
    assert state.dct_block_size == block
    assert pickle.loads(pickle.dumps(state)).basis_setting() == setting


def test_variants_are_frozen_and_compare_by_value():
    assert DCT() == DCT(block_size=64) and AutoDensity() == AutoDensity(0.01, 0.25)
    with pytest.raises(AttributeError):
        DCT().block_size = 32
