//! Reading a job's shape from launcher variables (torchrun, Open MPI) for
//! `symm_comm_init_from_env`, and the unique id it derives from them (or takes from
//! `SYMMALLOC_UNIQUE_ID`). A pure function of a variable lookup, so tests need no real env. The
//! FFI is its only caller; it uses only this layer (the host identity, the unique id).

use super::host::Host;
use super::unique_id::UniqueId;
use crate::error::{Error, Result};

#[derive(Debug, PartialEq, Eq)]
pub struct JobEnv {
    pub rank: i32,
    pub world: i32,
    pub device: i32,
    pub job_key: String,
}

fn int(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<i32> {
    let v = get(name)
        .ok_or_else(|| Error::invalid(format!("environment variable {name} is not set")))?;
    v.trim()
        .parse()
        .map_err(|_| Error::invalid(format!("{name}={v:?} is not an integer")))
}

pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<JobEnv> {
    if get("LOCAL_RANK").is_some() {
        let rank = int(get, "LOCAL_RANK")?;
        let world = int(get, "LOCAL_WORLD_SIZE")?;
        let job = match get("TORCHELASTIC_RUN_ID").filter(|v| !v.is_empty() && v != "none") {
            Some(id) => format!("torchrun:{id}"),
            None => {
                let addr = get("MASTER_ADDR").ok_or_else(|| {
                    Error::invalid(
                        "environment variable MASTER_ADDR is not set (needed with MASTER_PORT \
                         when TORCHELASTIC_RUN_ID is absent)",
                    )
                })?;
                let port = get("MASTER_PORT")
                    .ok_or_else(|| Error::invalid("environment variable MASTER_PORT is not set"))?;
                format!("torchrun:{addr}:{port}")
            }
        };
        return Ok(JobEnv {
            rank,
            world,
            device: rank,
            job_key: job,
        });
    }
    if get("OMPI_COMM_WORLD_LOCAL_RANK").is_some() {
        let rank = int(get, "OMPI_COMM_WORLD_LOCAL_RANK")?;
        let world = int(get, "OMPI_COMM_WORLD_LOCAL_SIZE")?;
        // Open MPI exports a job id in the process-management environment.
        let job = get("OMPI_MCA_ess_base_jobid")
            .or_else(|| get("PMIX_NAMESPACE"))
            .or_else(|| get("OMPI_MCA_orte_hnp_uri"))
            .ok_or_else(|| {
                Error::invalid(
                    "no Open MPI job id found (OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE)",
                )
            })?;
        return Ok(JobEnv {
            rank,
            world,
            device: rank,
            job_key: format!("mpi:{job}"),
        });
    }
    Err(Error::invalid(
        "environment variable LOCAL_RANK is not set (torchrun), nor OMPI_COMM_WORLD_LOCAL_RANK \
         (mpirun); use symm_comm_init with an explicit unique id instead",
    ))
}

/// The job's unique id: `SYMMALLOC_UNIQUE_ID` (the 256 hex digits of a `symm_get_unique_id`
/// id, handed out by the launcher: a secret no other process can derive) when set; otherwise
/// derived from the job key, which keeps other jobs out but not a process that can read the
/// job's variables (the Python `from_env` passes a fresh id through torchrun's store instead).
/// Empty (blank) counts as unset, as for every setting (src/config/). A derived id is per host
/// (`host`, this rank's): the launchers' local ranks and sizes count the ranks of one host.
pub fn unique_id(
    get: &dyn Fn(&str) -> Option<String>,
    job_key: &str,
    host: &Host,
) -> Result<UniqueId> {
    match get("SYMMALLOC_UNIQUE_ID").filter(|v| !v.trim().is_empty()) {
        Some(v) => UniqueId::from_hex(v.trim()).map_err(|e| {
            Error::invalid(format!(
                "environment variable SYMMALLOC_UNIQUE_ID={v:?} is not accepted: {}",
                e.message
            ))
        }),
        None => Ok(UniqueId::from_job_key(job_key, host)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    fn env(v: &[(&str, &str)]) -> Result<JobEnv> {
        let m: HashMap<_, _> = v
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_env(&|k| m.get(k).cloned())
    }
    #[test]
    fn torchrun_mpirun_and_missing() {
        let j = env(&[
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ])
        .unwrap();
        assert_eq!(
            j,
            JobEnv {
                rank: 1,
                world: 2,
                device: 1,
                job_key: "torchrun:abc".into()
            }
        );
        let j = env(&[
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(j.job_key, "torchrun:h:29500");
        let e = env(&[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.message.contains("MASTER_ADDR"), "{}", e.message);
        let e = env(&[("LOCAL_RANK", "0")]).unwrap_err();
        assert!(e.message.contains("LOCAL_WORLD_SIZE"), "{}", e.message);
        let j = env(&[
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("PMIX_NAMESPACE", "ns"),
        ])
        .unwrap();
        assert_eq!((j.rank, j.world, j.device), (3, 4, 3));
        assert!(env(&[]).unwrap_err().message.contains("LOCAL_RANK"));
        assert!(env(&[("LOCAL_RANK", "x"), ("LOCAL_WORLD_SIZE", "2")])
            .unwrap_err()
            .message
            .contains("not an integer"));
    }

    #[test]
    fn an_explicit_unique_id_wins_over_the_derived_one() {
        let h = Host::from_override("node-a");
        let fresh = UniqueId::generate().unwrap();
        let hex = crate::ipc::hex::hex(&fresh.to_bytes());
        let get = |k: &str| (k == "SYMMALLOC_UNIQUE_ID").then(|| hex.clone());
        let id = unique_id(&get, "torchrun:h:29500", &h).unwrap();
        assert_eq!(id, fresh);
        assert_ne!(id, UniqueId::from_job_key("torchrun:h:29500", &h));
        assert_eq!(
            unique_id(&|_| None, "torchrun:h:29500", &h).unwrap(),
            UniqueId::from_job_key("torchrun:h:29500", &h)
        );
        assert_eq!(
            unique_id(&|_| Some(" ".into()), "torchrun:h:29500", &h).unwrap(),
            UniqueId::from_job_key("torchrun:h:29500", &h),
            "blank is unset"
        );
        for bad in ["zz", "00", &hex[..254]] {
            let e = unique_id(&|_| Some(bad.to_string()), "k", &h).unwrap_err();
            assert!(
                e.message.starts_with(&format!(
                    "environment variable SYMMALLOC_UNIQUE_ID={bad:?} is not accepted:"
                )) && e.message.contains("256 hex digits"),
                "{}",
                e.message
            );
        }
    }
}
