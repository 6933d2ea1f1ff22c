//! The kernel map in docs/ARCHITECTURE.md is generated from the plan (`sagebwd plan --map`): this test fails when the
//! page is stale. To refresh it: `SAGEBWD_UPDATE_DOCS=1 cargo test --release -p sagebwd-cuda --test kernel_map`.

const BEGIN: &str = "<!-- kernel-plan:begin -->";
const END: &str = "<!-- kernel-plan:end -->";

#[test]
fn architecture_page_holds_the_current_kernel_map() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/ARCHITECTURE.md");
    let page = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let (Some(b), Some(e)) = (page.find(BEGIN), page.find(END)) else {
        panic!("{path} has no {BEGIN} … {END} section for the kernel map");
    };
    assert!(b < e, "{path}: {END} comes before {BEGIN}");
    let current = &page[b + BEGIN.len()..e];
    let generated = format!("\n{}", sagebwd_cuda::plan::kernel_map_markdown());
    if current != generated {
        if std::env::var("SAGEBWD_UPDATE_DOCS").as_deref() == Ok("1") {
            let updated = format!("{}{generated}{}", &page[..b + BEGIN.len()], &page[e..]);
            std::fs::write(path, updated).unwrap_or_else(|e| panic!("{path}: {e}"));
            return;
        }
        panic!(
            "the kernel map in {path} is stale; refresh it with \
                `SAGEBWD_UPDATE_DOCS=1 cargo test --release -p sagebwd-cuda --test kernel_map`. Expected:\n{generated}"
        );
    }
}
