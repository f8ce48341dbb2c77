//! A plugin named by a bare file name (no folder) loads the file of that name in the current
//! folder, the one the host checked exists, not one the dynamic loader would find in its own
//! search folders. Alone in its test binary: it changes the process's current folder.

#[test]
fn a_bare_file_name_loads_the_file_in_the_current_folder() {
    let path = iris_tests::plugin_library("cpu");
    let name = path.file_name().expect("a file name").to_owned();
    std::env::set_current_dir(iris_tests::artifact_dir()).expect("the artifact folder");
    let plugin = iris_plugin::loader::load_library(std::path::Path::new(&name))
        .unwrap_or_else(|err| panic!("{} did not load: {err}", name.display()));
    assert_eq!(plugin.path(), Some(path.as_path()));
    assert!(plugin.probe().device_count >= 1);
}
