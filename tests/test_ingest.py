"""Sources -> raw samples: every kind, sidecar faults, damaged tar shards, fsspec URIs and bad source tables."""

import hashlib
import io
import json
import tarfile
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from difftrain.data.prepare.ingest import RawSample, iter_source
from difftrain.data.prepare.refs import RefError, ShardError, read_ref
from difftrain.errors import UserError


def png_bytes(value: int = 0, size: tuple[int, int] = (8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write(path, data: bytes | str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def make_tar(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def by_key(samples):
    return {s.key: s for s in samples}


# --------------------------------------------------------------------------- sample ids


def test_sample_id_is_a_stable_63_bit_hash_of_source_and_key():
    s = RawSample("laion", "part0/abc", "t2i", ["x.png"], "a cat")
    want = int.from_bytes(hashlib.blake2b(b"laion\0part0/abc", digest_size=8).digest(), "big") & ((1 << 63) - 1)
    assert s.sample_id == want
    assert 0 <= s.sample_id < 1 << 63
    assert RawSample("laion", "part0/abc", "edit", [], None).sample_id == want  # only source and key count
    assert RawSample("laion2", "part0/abc", "t2i", [], None).sample_id != want
    assert RawSample("laion", "part0/abd", "t2i", [], None).sample_id != want


# --------------------------------------------------------------------------- folder


def test_folder_reads_images_and_sidecars_in_sorted_order(tmp_path):
    root = tmp_path / "imgs"
    write(root / "b" / "two.png", png_bytes(2))
    write(root / "b" / "two.txt", "  a red circle\n")
    write(root / "a" / "one.jpg", png_bytes(1))  # extension decides the kind, content is read later
    write(root / "a" / "one.json", json.dumps({"caption": "a blue square", "quality": 0.75, "nsfw": 0,
                                               "source_url": "http://x", "flag": True}))
    write(root / "c.png", png_bytes(3))  # no sidecar
    write(root / "d.webp", png_bytes(4))
    write(root / "d.txt", "caf\u00e9".encode("latin-1"))  # not UTF-8
    write(root / "e.png", png_bytes(5))
    write(root / "e.txt", "")  # empty caption is a caption, not an error
    write(root / "f.png", png_bytes(6))
    write(root / "f.json", json.dumps({"quality": 0.1}))  # json without caption
    write(root / "notes.md", "not an image")
    write(root / ".hidden" / "x.png", png_bytes(7))
    samples = list(iter_source({"name": "loc", "kind": "folder", "path": str(root)}))
    assert [s.key for s in samples] == ["a/one", "b/two", "c", "d", "e", "f"]
    s = by_key(samples)
    assert s["a/one"].caption == "a blue square" and s["a/one"].caption_error == ""
    assert s["a/one"].scores == {"quality": 0.75, "nsfw": 0.0, "flag": 1.0}
    assert s["b/two"].caption == "a red circle" and s["b/two"].scores == {}
    assert s["c"].caption is None and s["c"].caption_error == "missing sidecar"
    assert s["d"].caption is None and s["d"].caption_error == "not UTF-8"
    assert s["e"].caption == "" and s["e"].caption_error == ""
    assert s["f"].caption is None and s["f"].caption_error == "missing caption" and s["f"].scores == {"quality": 0.1}
    assert all(x.task == "t2i" and x.source == "loc" and len(x.refs) == 1 for x in samples)
    assert read_ref(s["b/two"].refs[0]) == png_bytes(2)
    assert read_ref(s["a/one"].refs[0]) == png_bytes(1)
    # Deterministic: a second listing is identical.
    again = list(iter_source({"name": "loc", "kind": "folder", "path": str(root)}))
    assert [(x.key, x.refs, x.caption, x.scores) for x in again] == [(x.key, x.refs, x.caption, x.scores)
                                                                      for x in samples]


def test_folder_glob_and_same_stem_with_two_extensions(tmp_path):
    write(tmp_path / "p1" / "a.png", png_bytes(1))
    write(tmp_path / "p1" / "a.jpg", png_bytes(2))
    write(tmp_path / "p2" / "b.png", png_bytes(3))
    write(tmp_path / "q" / "c.png", png_bytes(4))
    samples = list(iter_source({"name": "g", "kind": "folder", "path": str(tmp_path / "p*")}))
    assert [s.key for s in samples] == ["p1/a.jpg", "p1/a.png", "p2/b"]
    assert len({s.sample_id for s in samples}) == 3


# --------------------------------------------------------------------------- manifest


def test_jsonl_manifest_resolves_relative_paths_and_takes_numeric_scores(tmp_path):
    write(tmp_path / "data" / "img" / "x.png", png_bytes(9))
    rows = [
        {"id": "r1", "image": "img/x.png", "caption": "  a green triangle ", "quality": 0.9, "aesthetic": 5,
         "lang": "en"},
        {"image": "/abs/elsewhere.png", "caption": None, "quality": None},
        {"image": "memory://bucket/y.png", "caption": "remote"},
    ]
    write(tmp_path / "data" / "m.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    samples = list(iter_source({"name": "m", "kind": "manifest", "path": str(tmp_path / "data" / "m.jsonl")}))
    assert [s.key for s in samples] == ["r1", "m.jsonl:1", "m.jsonl:2"]
    a, b, c = samples
    assert a.refs == [str(tmp_path / "data" / "img" / "x.png")] and read_ref(a.refs[0]) == png_bytes(9)
    assert a.caption == "a green triangle" and a.scores == {"quality": 0.9, "aesthetic": 5.0}
    assert b.refs == ["/abs/elsewhere.png"] and b.caption is None and b.caption_error == "missing caption"
    assert b.scores == {}
    assert c.refs == ["memory://bucket/y.png"] and c.caption == "remote"


def test_parquet_manifests_for_edit_and_keyframes(tmp_path):
    pq.write_table(pa.table({
        "source": ["s0.png", "s1.png"], "target": ["t0.png", "t1.png"], "instruction": ["make it blue", None],
        "quality": pa.array([0.5, None], pa.float64()), "note": ["x", "y"],
    }), tmp_path / "edits.parquet")
    edits = list(iter_source({"name": "e", "kind": "manifest", "task": "edit",
                              "path": str(tmp_path / "edits.parquet")}))
    assert [s.key for s in edits] == ["edits.parquet:0", "edits.parquet:1"]
    assert edits[0].task == "edit"
    assert edits[0].refs == [str(tmp_path / "s0.png"), str(tmp_path / "t0.png")]
    assert edits[0].caption == "make it blue" and edits[0].scores == {"quality": 0.5}
    assert edits[1].caption is None and edits[1].caption_error == "missing instruction" and edits[1].scores == {}

    pq.write_table(pa.table({"id": [7], "frames": [["c/f0.png", "c/f1.png", "c/f2.png"]],
                             "caption": ["a circle moving"]}), tmp_path / "clips.parquet")
    clips = list(iter_source({"name": "k", "kind": "manifest", "task": "keyframes",
                              "path": [str(tmp_path / "clips.parquet")]}))
    assert len(clips) == 1 and clips[0].key == "7" and clips[0].task == "keyframes"
    assert clips[0].refs == [str(tmp_path / "c" / f"f{i}.png") for i in range(3)]


def test_manifest_missing_column_and_duplicate_ids_are_user_errors(tmp_path):
    write(tmp_path / "a.jsonl", json.dumps({"caption": "no image"}) + "\n")
    with pytest.raises(UserError, match=r"data\.sources\['bad'\]\.path: .*a\.jsonl:1: no 'image'"):
        list(iter_source({"name": "bad", "kind": "manifest", "path": str(tmp_path / "a.jsonl")}))
    write(tmp_path / "b.jsonl", "\n".join(json.dumps({"id": 1, "image": f"{i}.png", "caption": "c"})
                                          for i in range(2)))
    with pytest.raises(UserError, match="key '1' appears twice"):
        list(iter_source({"name": "dup", "kind": "manifest", "path": str(tmp_path / "b.jsonl")}))
    write(tmp_path / "c.jsonl", "{not json\n")
    with pytest.raises(UserError, match=r"c\.jsonl:1: not a JSON object"):
        list(iter_source({"name": "broken", "kind": "manifest", "path": str(tmp_path / "c.jsonl")}))


# --------------------------------------------------------------------------- webdataset


def test_webdataset_groups_members_by_key_and_reads_members(tmp_path):
    make_tar(tmp_path / "s-000.tar", [
        ("k1.png", png_bytes(1)), ("k1.txt", b"first caption\n"),
        ("k2.jpg", png_bytes(2)), ("k2.json", json.dumps({"caption": "second", "quality": 0.3}).encode()),
        ("k3.png", png_bytes(3)),
        ("orphan.txt", b"no image here"),
    ])
    make_tar(tmp_path / "s-001.tar", [("k4.png", png_bytes(4)), ("k4.txt", b"\xff\xfe")])
    samples = list(iter_source({"name": "w", "kind": "webdataset", "path": str(tmp_path)}))
    assert [s.key for s in samples] == ["k1", "k2", "k3", "k4"]
    s = by_key(samples)
    assert s["k1"].refs == [f"{tmp_path / 's-000.tar'}#k1.png"] and s["k1"].caption == "first caption"
    assert s["k2"].caption == "second" and s["k2"].scores == {"quality": 0.3}
    assert s["k3"].caption is None and s["k3"].caption_error == "missing sidecar"
    assert s["k4"].caption is None and s["k4"].caption_error == "not UTF-8"
    assert [read_ref(x.refs[0]) for x in samples] == [png_bytes(i) for i in (1, 2, 3, 4)]
    only = list(iter_source({"name": "w", "kind": "webdataset", "path": str(tmp_path / "s-001.tar")}))
    assert [x.key for x in only] == ["k4"]


def test_webdataset_edit_and_keyframes_conventions(tmp_path):
    make_tar(tmp_path / "e.tar", [("a.source.png", png_bytes(1)), ("a.target.png", png_bytes(2)),
                                  ("a.instruction.txt", b"make it red")])
    (e,) = iter_source({"name": "we", "kind": "webdataset", "task": "edit", "path": str(tmp_path / "e.tar")})
    assert [read_ref(r) for r in e.refs] == [png_bytes(1), png_bytes(2)] and e.caption == "make it red"
    make_tar(tmp_path / "k.tar", [(f"c.frame_{i:03d}.png", png_bytes(i)) for i in (2, 0, 1)] + [("c.txt", b"go")])
    (k,) = iter_source({"name": "wk", "kind": "webdataset", "task": "keyframes", "path": str(tmp_path / "k.tar")})
    assert [read_ref(r) for r in k.refs] == [png_bytes(i) for i in (0, 1, 2)] and k.caption == "go"


def test_truncated_tar_member_is_a_per_sample_fault(tmp_path):
    good = make_tar(tmp_path / "full.tar", [("a.png", png_bytes(1, (32, 32))), ("a.txt", b"cap a"),
                                            ("b.png", png_bytes(2, (64, 64))), ("b.txt", b"cap b")])
    data = good.read_bytes()
    with tarfile.open(good) as tf:
        b = tf.getmember("b.png")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: b.offset_data + b.size // 2])  # the shard ends inside b.png
    errors: list[str] = []
    samples = list(iter_source({"name": "t", "kind": "webdataset", "path": str(cut)}, errors=errors))
    assert [s.key for s in samples] == ["a", "b"]
    assert read_ref(samples[0].refs[0]) == png_bytes(1, (32, 32))
    assert samples[1].refs == [f"{cut}#b.png"]  # still listed ...
    with pytest.raises(RefError, match=r"cut\.tar#b\.png: truncated tar member"):
        read_ref(samples[1].refs[0])  # ... but reading it is a per-sample error
    assert samples[1].caption is None and samples[1].caption_error == "missing sidecar"  # b.txt was cut off
    assert len(errors) == 1 and "cut.tar" in errors[0] and "'b.png'" in errors[0]
    # Without a collector the iteration still completes: one bad member is not a broken source.
    assert [s.key for s in iter_source({"name": "t", "kind": "webdataset", "path": str(cut)})] == ["a", "b"]


def test_corrupt_tar_header_yields_what_was_read_then_names_the_shard(tmp_path):
    good = make_tar(tmp_path / "ok.tar", [("a.png", png_bytes(1)), ("a.txt", b"cap a"), ("b.png", png_bytes(2)),
                                          ("b.txt", b"cap b")])
    with tarfile.open(good) as tf:
        hdr = tf.getmember("b.png").offset
    data = bytearray(good.read_bytes())
    data[hdr:hdr + 16] = b"#garbage-header!"
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    it = iter_source({"name": "c", "kind": "webdataset", "path": str(bad)})
    first = next(it)
    assert first.key == "a" and first.caption == "cap a" and read_ref(first.refs[0]) == png_bytes(1)
    with pytest.raises(ShardError, match=r"bad\.tar: corrupt tar header at byte \d+"):
        next(it)
    errors: list[str] = []
    assert [s.key for s in iter_source({"name": "c", "kind": "webdataset", "path": str(bad)}, errors=errors)] == ["a"]
    assert len(errors) == 1 and "bad.tar" in errors[0]
    with pytest.raises(RefError, match=r"no such member .*listing is incomplete"):
        read_ref(f"{bad}#b.png")
    (tmp_path / "junk").mkdir()
    write(tmp_path / "junk" / "x.tar", b"this is not a tar archive at all" * 40)
    errors = []
    assert list(iter_source({"name": "j", "kind": "webdataset", "path": str(tmp_path / "junk")}, errors)) == []
    assert len(errors) == 1 and "not a readable tar" in errors[0]


# --------------------------------------------------------------------------- edit and keyframes folders


def test_edit_folder_triples(tmp_path):
    root = tmp_path / "edits"
    for key, val in (("e1", 10), ("e2", 20)):
        write(root / key / "source.png", png_bytes(val))
        write(root / key / "target.png", png_bytes(val + 1))
        write(root / key / "instruction.txt", f"edit {key}\n")
    write(root / "e1" / "scores.json", json.dumps({"quality": 0.4}))
    write(root / "e3" / "source.png", png_bytes(30))  # target and instruction missing
    write(root / "manifest.jsonl", "{}\n")  # files at the top level are not triples
    samples = list(iter_source({"name": "ed", "kind": "edit", "path": str(root)}))
    assert [s.key for s in samples] == ["e1", "e2", "e3"]
    e1, e2, e3 = samples
    assert e1.task == "edit" and e1.caption == "edit e1" and e1.scores == {"quality": 0.4}
    assert [read_ref(r) for r in e2.refs] == [png_bytes(20), png_bytes(21)] and e2.scores == {}
    assert e3.caption is None and e3.caption_error == "missing sidecar"
    assert e3.refs[1] == str(root / "e3" / "target.png")
    with pytest.raises(RefError, match=r"e3/target\.png: file not found"):
        read_ref(e3.refs[1])


def test_keyframes_folder_sorts_frames_numerically(tmp_path):
    root = tmp_path / "clips"
    for i in (0, 1, 2, 10):
        write(root / "c1" / f"frame_{i}.png", png_bytes(i))
    write(root / "c1" / "caption.txt", "a square moving")
    write(root / "c2" / "frame_000.png", png_bytes(50))
    write(root / "c2" / "frame_001.png", png_bytes(51))
    write(root / "c2" / "preview.png", png_bytes(99))  # not a frame
    samples = list(iter_source({"name": "kf", "kind": "keyframes", "path": str(root)}))
    assert [s.key for s in samples] == ["c1", "c2"]
    assert [read_ref(r) for r in samples[0].refs] == [png_bytes(i) for i in (0, 1, 2, 10)]
    assert samples[0].caption == "a square moving" and samples[0].task == "keyframes"
    assert len(samples[1].refs) == 2 and samples[1].caption_error == "missing sidecar"


# --------------------------------------------------------------------------- fsspec


def test_memory_filesystem_for_folder_webdataset_and_manifest():
    root = f"memory://ingest-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe(f"{root}/imgs/x.png", png_bytes(11))
        fs.pipe(f"{root}/imgs/x.txt", b"in memory")
        fs.pipe(f"{root}/imgs/sub/y.png", png_bytes(12))
        samples = list(iter_source({"name": "mem", "kind": "folder", "path": f"{root}/imgs"}))
        assert [s.key for s in samples] == ["sub/y", "x"]
        assert all(s.refs[0].startswith("memory://") for s in samples)
        assert read_ref(samples[1].refs[0]) == png_bytes(11) and samples[1].caption == "in memory"

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
            for name, data in (("m.png", png_bytes(13)), ("m.txt", b"from a shard")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        fs.pipe(f"{root}/shards/a.tar", buf.getvalue())
        (w,) = iter_source({"name": "memw", "kind": "webdataset", "path": f"{root}/shards/*.tar"})
        assert w.refs[0].startswith("memory://") and w.refs[0].endswith("a.tar#m.png")
        assert read_ref(w.refs[0]) == png_bytes(13) and w.caption == "from a shard"

        fs.pipe(f"{root}/man/rows.jsonl", (json.dumps({"image": "../imgs/x.png", "caption": "rel"}) + "\n").encode())
        (m,) = iter_source({"name": "memm", "kind": "manifest", "path": f"{root}/man/rows.jsonl"})
        assert read_ref(m.refs[0]) == png_bytes(11)
        with pytest.raises(RefError, match="memory://.*nope.png"):
            read_ref(f"{root}/nope.png")
    finally:
        fs.rm(root.replace("memory://", "/"), recursive=True)


# --------------------------------------------------------------------------- bad specs


@pytest.mark.parametrize("spec, pattern", [
    ({"name": "s", "kind": "zip", "path": "x"}, r"data\.sources\['s'\]\.kind: unknown kind 'zip'; expected one of"),
    ({"name": "s", "kind": "folder"}, r"data\.sources\['s'\]\.path: missing or empty; expected a folder"),
    ({"name": "s", "kind": "folder", "path": "/definitely/not/here"},
     r"data\.sources\['s'\]\.path: '/definitely/not/here' matches nothing; expected a folder of images"),
    ({"name": "s", "kind": "folder", "path": "x", "task": "edit"},
     r"data\.sources\['s'\]\.task: kind 'folder' cannot hold task 'edit'; expected t2i"),
    ({"name": "s", "kind": "manifest", "path": "x", "task": "video"}, r"\.task: unknown task 'video'"),
    # a name defaults to one path's last part (normalize_spec); a list of paths gives none
    ({"kind": "manifest", "path": ["a.jsonl", "b.jsonl"]}, r"data\.sources: a source has no 'name'"),
])
def test_bad_source_tables_are_user_errors(spec, pattern):
    with pytest.raises(UserError, match=pattern):
        iter_source(spec)  # raised at call time, before any iteration


def test_paths_matching_nothing_useful(tmp_path):
    write(tmp_path / "only.txt", "no images")
    with pytest.raises(UserError, match=r"data\.sources\['f'\]\.path: no images"):
        iter_source({"name": "f", "kind": "folder", "path": str(tmp_path)})
    with pytest.raises(UserError, match=r"data\.sources\['w'\]\.path: no \.tar shards"):
        iter_source({"name": "w", "kind": "webdataset", "path": str(tmp_path)})
    with pytest.raises(UserError, match=r"data\.sources\['m'\]\.path: .*matches nothing"):
        iter_source({"name": "m", "kind": "manifest", "path": str(tmp_path / "*.parquet")})
    with pytest.raises(UserError, match=r"data\.sources\['k'\]\.path: no clips"):
        iter_source({"name": "k", "kind": "keyframes", "path": str(tmp_path)})
    with pytest.raises(UserError, match=r"data\.sources\['e'\]\.path: no edit triples"):
        iter_source({"name": "e", "kind": "edit", "path": str(tmp_path)})


def test_read_ref_errors_name_the_ref(tmp_path):
    with pytest.raises(RefError, match=r"missing\.png: file not found"):
        read_ref(str(tmp_path / "missing.png"))
    make_tar(tmp_path / "s.tar", [("a.png", b"123")])
    assert read_ref(f"{tmp_path / 's.tar'}#a.png") == b"123"
    assert read_ref(f"file://{tmp_path / 's.tar'}#a.png") == b"123"
    with pytest.raises(RefError, match=r"s\.tar#zz\.png: no such member"):
        read_ref(f"{tmp_path / 's.tar'}#zz.png")
    write(tmp_path / "odd#name.png", b"abc")  # a '#' that is not after a .tar is part of the path
    assert read_ref(str(tmp_path / "odd#name.png")) == b"abc"
    assert issubclass(RefError, ValueError) and not issubclass(RefError, UserError)
