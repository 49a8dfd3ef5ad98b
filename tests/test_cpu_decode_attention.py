"""paged_decode_attention (the CPU plugin's decode kernel) against a float64 reference, on the edge
cases of its AVX-512 path: 2 or 4 token streams per piece in blocks of 16 / S steps (lengths around
a block and a stream), pages smaller than a block, head sizes that take each code path (16 .. 128 in
steps of 16 on AVX-512; other multiples of 8, and every size on an AVX2 build, the AVX2 path; 20 the
portable one), grouped heads (1 to 8 query heads a kv head: each register count of the AVX2 value
pass), peaked softmaxes, and block tables whose unused entries must not be read; float32 pools and
bfloat16 ones (each value widened in registers)."""
import pytest
import torch

from polychip.devices.cpu import kernels as cpu_kernels

kernels = cpu_kernels.load()
pytestmark = [pytest.mark.device_independent,     # the CPU plugin's own kernels (conftest.py)
              pytest.mark.skipif(kernels is None, reason="CPU kernels did not build here (see the log)")]


def _reference(q, kc, vc, table, lens, scale):
    page, hkv, d = kc.shape[1:]
    flat_k, flat_v = kc.reshape(-1, hkv, d).double(), vc.reshape(-1, hkv, d).double()
    group = q.shape[1] // hkv
    out = []
    for b, length in enumerate(lens.tolist()):
        t = torch.arange(length)
        rows = table[b][t // page] * page + t % page
        k = flat_k[rows].repeat_interleave(group, 1)          # [L, H, D]
        v = flat_v[rows].repeat_interleave(group, 1)
        w = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", w, v))
    return torch.stack(out).float()


def _case(heads, kv_heads, d, lengths, page=16, seed=0, q_scale=1.0, spare=0, dtype=torch.float32):
    """Caches with pages in random order; spare extra block-table columns hold page ids far outside
    the pool (reading one would crash or show in the result)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = int((lens.max() + page - 1) // page)
    pages = max(8, width * len(lengths))
    kc = torch.randn(pages, page, kv_heads, d, generator=g)
    vc = torch.randn(pages, page, kv_heads, d, generator=g)
    kc, vc = kc.to(dtype), vc.to(dtype)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in lengths])
    for b, length in enumerate(lengths):        # past each sequence's last page: ids out of the pool
        table[b, (length + page - 1) // page:] = 1 << 40
    if spare:
        table = torch.cat([table, torch.full((len(lengths), spare), 1 << 40)], 1)
    q = torch.randn(len(lengths), heads, d, generator=g) * q_scale
    return q, kc, vc, table, lens, d ** -0.5


def _check(args, threads=2):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, _reference(*args), atol=2e-5, rtol=1e-5)


# around a block of 16 steps, 4 streams of 4-step blocks and 2 streams of 8-step blocks
LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 96, 112, 128, 24, 144, 8, 40, 20])
def test_head_sizes(d, dtype):
    _check(_case(9, 3, d, LENGTHS, seed=d, dtype=dtype))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (16, 2), (6, 3), (1, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_head_layouts(heads, kv_heads, d, dtype):
    _check(_case(heads, kv_heads, d, LENGTHS, seed=heads * d, dtype=dtype))


@pytest.mark.parametrize("page", [1, 3, 8, 12, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_page_sizes(page, d, dtype):
    # pages smaller than a block, or not dividing it: blocks and streams cross pages mid-way
    _check(_case(9, 3, d, [1, 15, 16, 17, 31, 33, 100, 257], page=page, seed=page, dtype=dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("length", [255, 256, 257, 700, 2001])
def test_long_sequences_cut_into_pieces(threads, length):
    # a lone sequence is cut into pieces of whole pages (one per thread or more), merged by their max and sum
    _check(_case(9, 3, 64, [length], seed=length), threads)
    _check(_case(9, 3, 64, [length, 5, length // 2], seed=length + 1), threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_peaked_softmax(dtype):
    # large scores: weights span many orders of magnitude and most underflow to 0
    _check(_case(9, 3, 64, [1, 17, 33, 300], q_scale=30.0, dtype=dtype))
    _check(_case(4, 4, 128, [1, 17, 33, 300], q_scale=30.0, seed=1, dtype=dtype))


def test_block_table_wider_than_needed():
    _check(_case(9, 3, 64, [1, 16, 17, 40], page=8, spare=3))


def _verify_batch(n, rows, d, page, dtype, seed):
    """A batch of three sequences: X (one row, 37 tokens), Y (``rows`` rows at lengths n .. n + rows - 1:
    a verify step) and Z (one row, 300 tokens), each with its own pages in random order."""
    g = torch.Generator().manual_seed(seed)
    lens = [37, *range(n, n + rows), 300]
    width = (max(lens) + page - 1) // page
    pages = 3 * width + 1
    kc = torch.randn(pages, page, 3, d, generator=g).to(dtype)
    vc = torch.randn(pages, page, 3, d, generator=g).to(dtype)
    perm = torch.randperm(pages, generator=g)
    own = [perm[i * width:(i + 1) * width] for i in range(3)]
    table = torch.stack([own[0], *[own[1]] * rows, own[2]])
    q = torch.randn(len(lens), 9, d, generator=g)
    return q, kc, vc, table, torch.tensor(lens), d ** -0.5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d,page,dtype", [(64, 16, torch.bfloat16), (64, 3, torch.float32),
                                          (128, 16, torch.bfloat16), (64, 16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("n", [1, 14, 30, 127, 400, 797])
def test_a_verify_steps_rows_give_each_the_bits_of_a_decode_row(threads, d, page, dtype, n):
    # Y's rows, read in one walk of its K/V rows, each equal (bit for bit) Y decoding alone at that length
    # beside X and Z (the same number of sequences), and the float64 reference; lengths cross pieces, streams'
    # blocks and pages
    rows = 9
    q, kc, vc, table, lens, scale = _verify_batch(n, rows, d, page, dtype, seed=n + d + page)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = kernels.paged_decode_attention(q, kc, vc, table, lens, scale, 1.0, 1.0)
        for j in range(rows):
            keep = [0, 1 + j, rows + 1]
            alone = kernels.paged_decode_attention(q[keep], kc, vc, table[keep], lens[keep], scale, 1.0, 1.0)
            assert torch.equal(batch[1 + j], alone[1]), j
            assert torch.equal(batch[0], alone[0]) and torch.equal(batch[-1], alone[2])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(batch, _reference(q, kc.float(), vc.float(), table, lens, scale), atol=2e-5, rtol=1e-5)


def test_rows_that_share_only_their_first_pages_are_not_one_sequence():
    # two sequences whose first pages are one cached prefix, at consecutive lengths: each reads its own later pages
    q, kc, vc, table, lens, scale = _verify_batch(100, 2, 64, 16, torch.float32, seed=5)
    table[2, 2:] = table[0, 2:]        # row 2 (length 101) keeps row 1's first two pages, then X's pages
    _check((q, kc, vc, table, lens, scale))
