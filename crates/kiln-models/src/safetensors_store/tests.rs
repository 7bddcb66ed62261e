use std::io::Write;

use super::*;

fn write_file(dir: &Path, name: &str, header: &str, data: &[u8]) -> PathBuf {
    let path = dir.join(name);
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    f.write_all(data).unwrap();
    path
}

/// A scratch directory, removed when dropped.
fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("kiln-st-{tag}-")).tempdir().unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn reads_matrices_and_vectors_aligned_or_not() {
    let scratch = temp_dir("ok");
    let dir = scratch.path();
    let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, -0.5]);
    // Header lengths 8-aligned and odd: tensors at aligned and unaligned offsets.
    for pad in ["", " "] {
        let header = format!(
            r#"{{"w":{{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}},"b":{{"dtype":"F32","shape":[2],"data_offsets":[24,32]}}}}{pad}"#
        );
        let path = write_file(dir, "model.safetensors", &header, &data);
        let store = WeightStore::open_files(&[path]).unwrap();
        let w = store.matrix("w", 2, 3).unwrap().to_f32_vec().unwrap();
        assert_eq!(w[3..], [4.0, 5.0, 6.0]);
        assert_eq!(store.vector("b", 2).unwrap(), vec![0.5, -0.5]);
    }
}

#[test]
fn hostile_headers_give_errors_naming_file_and_tensor() {
    let scratch = temp_dir("bad");
    let dir = scratch.path();
    let data = f32_bytes(&[0.0; 6]);
    let cases = [
        (r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,4000]}}"#, "outside"),
        (r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[16,8]}}"#, "outside"),
        (r#"{"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,24]}}"#, "needs 32 bytes"),
        (
            r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,24]}}"#,
            "overflows",
        ),
        (r#"{"w":{"dtype":"F32","shape":[-1,3],"data_offsets":[0,24]}}"#, "non-negative"),
        (r#"{"w":{"dtype":"F32","shape":[2,3]}}"#, "data_offsets"),
        (r#"{"w":{"shape":[2,3],"data_offsets":[0,24]}}"#, "missing dtype"),
        ("[1,2,3]", "not a JSON object"),
        (r#"{"w":"#, "not valid JSON"),
        (
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            "tensors `a` (data_offsets [0, 16]) and `b` ([8, 16]) overlap",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},"b":{"dtype":"F32","shape":[1],"data_offsets":[20,24]},"c":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}"#,
            "tensors `a` (data_offsets [0, 24]) and `b` ([20, 24]) overlap",
        ),
    ];
    for (header, needle) in cases {
        let path = write_file(dir, "bad.safetensors", header, &data);
        let msg = WeightStore::open_files(&[path]).err().unwrap().to_string();
        assert!(msg.contains(needle) && msg.contains("bad.safetensors"), "{header}: {msg}");
    }
    // A header length past the end of the file.
    let path = dir.join("huge.safetensors");
    std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
    assert!(WeightStore::open_files(&[path]).err().unwrap().to_string().contains("header length"));
}

#[test]
fn truncation_at_every_byte_is_an_error_not_a_panic() {
    let scratch = temp_dir("trunc");
    let dir = scratch.path();
    let header = r#"{"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}"#;
    let full = write_file(dir, "full.safetensors", header, &[7u8; 12]);
    let bytes = std::fs::read(&full).unwrap();
    for cut in 0..bytes.len() {
        let path = dir.join("cut.safetensors");
        std::fs::write(&path, &bytes[..cut]).unwrap();
        assert!(WeightStore::open_files(&[path]).is_err(), "cut at {cut}");
    }
}

#[test]
fn wrong_shape_dtype_and_missing_tensors_are_named() {
    let scratch = temp_dir("shape");
    let dir = scratch.path();
    let header = r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"i":{"dtype":"I32","shape":[2],"data_offsets":[24,32]}}"#;
    let path = write_file(dir, "m.safetensors", header, &[0u8; 32]);
    let store = WeightStore::open_files(&[path]).unwrap();
    let msg = store.matrix("w", 3, 2).err().unwrap().to_string();
    assert!(msg.contains("`w`") && msg.contains("[2, 3]") && msg.contains("[3, 2]"), "{msg}");
    let msg = store.vector("i", 2).err().unwrap().to_string();
    assert!(msg.contains("I32"), "{msg}");
    let msg = store.matrix("nope", 1, 1).err().unwrap().to_string();
    assert!(msg.contains("`nope` not found"), "{msg}");
}

#[test]
fn index_with_path_traversal_or_duplicates_is_rejected() {
    let scratch = temp_dir("index");
    let dir = scratch.path();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map":{"w":"../../etc/passwd"}}"#,
    )
    .unwrap();
    let msg = WeightStore::open_dir(dir).err().unwrap().to_string();
    assert!(msg.contains("not a plain file name"), "{msg}");
    let header = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    write_file(dir, "a.safetensors", header, &[0; 4]);
    write_file(dir, "b.safetensors", header, &[0; 4]);
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map":{"w":"a.safetensors","x":"b.safetensors"}}"#,
    )
    .unwrap();
    let msg = WeightStore::open_dir(dir).err().unwrap().to_string();
    assert!(msg.contains("more than one shard"), "{msg}");
}
