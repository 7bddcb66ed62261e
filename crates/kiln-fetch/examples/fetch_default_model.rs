//! Fetches the default model (if not cached) and prints its path, for shell scripts:
//! `MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model)"`.

fn main() -> std::process::ExitCode {
    match kiln_fetch::fetch_default_model(&kiln_fetch::FetchConfig::from_env()) {
        Ok(path) => {
            println!("{}", path.display());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
