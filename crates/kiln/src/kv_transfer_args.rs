//! `kiln serve --kv-role`: prefill/decode disaggregation's flags (kiln-server's `kv_transfer`
//! does the work), and vLLM's `--kv-transfer-config` JSON read into them.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use kiln_server::kv_transfer::{KvRole, KvTransferConfig};

#[derive(clap::Args, Clone, Debug)]
#[expect(clippy::struct_field_names, reason = "the fields are the flags, which vLLM names so")]
pub struct KvTransferArgs {
    /// Prefill/decode disaggregation: `prefill` computes prompts and hands their KV to decode
    /// workers, `decode` fetches it from prefill workers before decoding, `both` does either
    /// per request. Orchestrated by vLLM's router or proxy through `kv_transfer_params`
    /// (docs/DEPLOYMENT.md). Default: off.
    #[arg(long, value_parser = parse_role)]
    kv_role: Option<KvRole>,
    /// vLLM's KV transfer settings as JSON, e.g. `{"kv_connector": "NixlConnector",
    /// "kv_role": "kv_both"}`: `kv_role` (kv_producer, kv_consumer, kv_both) sets --kv-role,
    /// `kv_ip` and `kv_port` the listener; kiln moves KV over its own protocol whatever the
    /// connector.
    #[arg(long, value_name = "JSON")]
    kv_transfer_config: Option<String>,
    /// Address the KV transfer listener binds (prefill and both roles).
    #[arg(long, default_value = "127.0.0.1")]
    kv_transfer_host: IpAddr,
    /// Port of the KV transfer listener (0: any free port).
    #[arg(long, default_value_t = 5600)]
    kv_transfer_port: u16,
    /// The host decode workers are told to connect to (`remote_host`), when it is not the
    /// bind address (a pod's IP when binding 0.0.0.0).
    #[arg(long)]
    kv_transfer_advertise_host: Option<String>,
    /// The secret prefill and decode workers prove they share (default: the first
    /// --api-key). Required when the listener binds a non-loopback address.
    #[arg(long, env = "KILN_KV_TRANSFER_SECRET", hide_env_values = true)]
    kv_transfer_secret: Option<String>,
    /// Seconds a prefill worker keeps a prompt's KV for a decode worker that never fetches it.
    #[arg(long, default_value_t = 120.0)]
    kv_pin_timeout: f64,
}

fn parse_role(value: &str) -> Result<KvRole, String> {
    match value {
        "prefill" | "kv_producer" => Ok(KvRole::Prefill),
        "decode" | "kv_consumer" => Ok(KvRole::Decode),
        "both" | "kv_both" => Ok(KvRole::Both),
        other => Err(format!("{other:?}: expected prefill, decode or both")),
    }
}

/// What `--kv-transfer-config` contributes.
#[derive(Debug, Default, PartialEq)]
struct VllmTransferConfig {
    role: Option<KvRole>,
    ip: Option<IpAddr>,
    port: Option<u16>,
}

fn parse_vllm_config(json: &str) -> anyhow::Result<VllmTransferConfig> {
    let value: serde_json::Value =
        serde_json::from_str(json).context("--kv-transfer-config: not JSON")?;
    let map = value.as_object().context("--kv-transfer-config: not a JSON object")?;
    let mut out = VllmTransferConfig::default();
    for (key, v) in map {
        match key.as_str() {
            "kv_role" => {
                let role = v.as_str().context("--kv-transfer-config: kv_role is not a string")?;
                out.role = Some(parse_role(role).map_err(anyhow::Error::msg)?);
            }
            "kv_ip" => {
                let ip = v.as_str().context("--kv-transfer-config: kv_ip is not a string")?;
                out.ip =
                    Some(ip.parse().with_context(|| format!("--kv-transfer-config: kv_ip {ip}"))?);
            }
            "kv_port" => {
                let port = v.as_u64().and_then(|p| u16::try_from(p).ok());
                out.port = Some(port.context("--kv-transfer-config: kv_port is not a port")?);
            }
            "kv_connector" => {
                if let Some(name) = v.as_str() {
                    tracing::info!(
                        "--kv-transfer-config: {name} requested; kiln moves KV over its own protocol"
                    );
                }
            }
            "kv_buffer_device" | "kv_connector_extra_config" | "engine_id" => {
                tracing::warn!("--kv-transfer-config: {key} has no effect in kiln");
            }
            other => anyhow::bail!("--kv-transfer-config: {other} is not supported"),
        }
    }
    Ok(out)
}

impl KvTransferArgs {
    /// The server's transfer settings (`None`: no role given); `api_keys` are the server's.
    pub fn config(&self, api_keys: &[String]) -> anyhow::Result<Option<KvTransferConfig>> {
        let vllm = match &self.kv_transfer_config {
            Some(json) => parse_vllm_config(json)?,
            None => VllmTransferConfig::default(),
        };
        let Some(role) = self.kv_role.or(vllm.role) else {
            anyhow::ensure!(
                self.kv_transfer_config.is_none(),
                "--kv-transfer-config needs a kv_role (or --kv-role)"
            );
            return Ok(None);
        };
        let ip = vllm.ip.unwrap_or(self.kv_transfer_host);
        let listen = SocketAddr::new(ip, vllm.port.unwrap_or(self.kv_transfer_port));
        let secret = self.kv_transfer_secret.clone().or_else(|| api_keys.first().cloned());
        let exports = matches!(role, KvRole::Prefill | KvRole::Both);
        let secret = match secret {
            Some(s) => s.into_bytes(),
            None if exports && !ip.is_loopback() => anyhow::bail!(
                "--kv-role {role}: a KV transfer listener on {ip} needs --kv-transfer-secret \
                 (or --api-key), shared with the decode workers"
            ),
            None => {
                tracing::warn!(
                    "KV transfer without a secret (--kv-transfer-secret): any local process can \
                     fetch pinned KV"
                );
                Vec::new()
            }
        };
        anyhow::ensure!(
            self.kv_pin_timeout.is_finite()
                && self.kv_pin_timeout > 0.0
                && self.kv_pin_timeout < 1e7,
            "--kv-pin-timeout must be a positive number of seconds"
        );
        Ok(Some(KvTransferConfig {
            role,
            listen,
            advertise_host: self.kv_transfer_advertise_host.clone(),
            secret,
            pin_timeout: Duration::from_secs_f64(self.kv_pin_timeout),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_transfer_config_maps_onto_the_role_and_listener() {
        let c = parse_vllm_config(
            r#"{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": 7001}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            VllmTransferConfig { role: Some(KvRole::Prefill), ip: None, port: Some(7001) }
        );
        assert!(parse_vllm_config(r#"{"kv_role": "kv_sideways"}"#).is_err());
        assert!(parse_vllm_config(r#"{"kv_parallel_size": 2}"#).is_err());
        assert!(parse_vllm_config("[]").is_err());
    }
}
