//! The multicast safety gate, a pure function of the environment and the device's capability.
//!
//! Multimem runs only when `SYMMALLOC_ENABLE_MULTICAST=1` is set AND none of
//! `NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1` is set
//! (disabling always wins) AND ranks do not share a GPU (`SYMMALLOC_SHARED_GPU`) AND the device
//! reports multicast support. Creating a multicast
//! object on a shared host that disallows it can take its GPUs out of service, so nothing in
//! this library reaches `cuMulticastCreate` unless this gate says yes.

/// `Ok(())` when multicast may be used; otherwise the reason, for the error message.
pub fn multicast_gate(
    env: &dyn Fn(&str) -> Option<String>,
    device_supports: bool,
) -> Result<(), String> {
    let is = |k: &str, v: &str| env(k).is_some_and(|x| x.trim() == v);
    for (k, v) in [
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ] {
        if is(k, v) {
            return Err(format!(
                "multicast is disabled by {k}={v} in the environment (disabling always wins)"
            ));
        }
    }
    let vars = crate::config::Vars::new(env);
    // A value that is not a boolean counts as sharing: it keeps multicast off.
    if vars.shared_gpu().unwrap_or(true) {
        return Err("multicast is off while ranks share a GPU (SYMMALLOC_SHARED_GPU)".into());
    }
    // Only the opt-in `1` turns it on; any other value keeps it off, and garbage is named.
    vars.enable_multicast().map_err(|e| e.message)?;
    if !is("SYMMALLOC_ENABLE_MULTICAST", "1") {
        return Err(
            "multicast is off by default; set SYMMALLOC_ENABLE_MULTICAST=1 to opt in \
                    (never on shared machines that forbid it)"
                .into(),
        );
    }
    if !device_supports {
        return Err(
            "the device does not support multicast objects (needs NVSwitch, sm_90+)".into(),
        );
    }
    Ok(())
}

/// The gate over the real process environment.
pub fn multicast_gate_from_env(device_supports: bool) -> Result<(), String> {
    multicast_gate(&crate::config::var, device_supports)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn gate(vars: &[(&str, &str)], dev: bool) -> Result<(), String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        multicast_gate(&|k| m.get(k).cloned(), dev)
    }

    #[test]
    fn off_by_default_and_disabling_wins() {
        assert!(gate(&[], true)
            .unwrap_err()
            .contains("SYMMALLOC_ENABLE_MULTICAST"));
        assert!(gate(&[("SYMMALLOC_ENABLE_MULTICAST", "1")], true).is_ok());
        assert!(gate(&[("SYMMALLOC_ENABLE_MULTICAST", "1")], false)
            .unwrap_err()
            .contains("support"));
        for (k, v) in [
            ("NCCL_NVLS_ENABLE", "0"),
            ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
            ("NVSHMEM_DISABLE_NVLS", "1"),
        ] {
            let e = gate(&[("SYMMALLOC_ENABLE_MULTICAST", "1"), (k, v)], true).unwrap_err();
            assert!(e.contains(k), "{e}");
        }
        assert!(gate(&[("SYMMALLOC_ENABLE_MULTICAST", "0")], true).is_err());
        // Ranks that share a GPU never reach multicast, whatever else is set.
        let e = gate(
            &[
                ("SYMMALLOC_ENABLE_MULTICAST", "1"),
                ("SYMMALLOC_SHARED_GPU", "1"),
            ],
            true,
        )
        .unwrap_err();
        assert!(e.contains("SYMMALLOC_SHARED_GPU"), "{e}");
        assert!(gate(
            &[
                ("SYMMALLOC_ENABLE_MULTICAST", "1"),
                ("NCCL_NVLS_ENABLE", "1")
            ],
            true
        )
        .is_ok());
    }

    #[test]
    fn only_the_opt_in_one_enables_and_garbage_is_named() {
        for v in ["0", "false", "off", "true", "on"] {
            assert!(
                gate(&[("SYMMALLOC_ENABLE_MULTICAST", v)], true).is_err(),
                "{v}"
            );
        }
        let e = gate(&[("SYMMALLOC_ENABLE_MULTICAST", "maybe")], true).unwrap_err();
        // The refusal names the variable and quotes the value.
        assert!(
            e.contains("SYMMALLOC_ENABLE_MULTICAST") && e.contains("\"maybe\" is not accepted"),
            "{e}"
        );
        let e = gate(
            &[
                ("SYMMALLOC_ENABLE_MULTICAST", "1"),
                ("SYMMALLOC_SHARED_GPU", "garbage"),
            ],
            true,
        )
        .unwrap_err();
        assert!(e.contains("share a GPU"), "{e}");
    }

    /// Shared GPU machines that forbid multicast set all three disabling variables; on them the gate must refuse.
    #[test]
    fn refuses_on_this_machine_when_disabled() {
        if crate::config::var("NCCL_NVLS_ENABLE").as_deref() == Some("0") {
            assert!(multicast_gate_from_env(true).is_err());
        }
    }
}
