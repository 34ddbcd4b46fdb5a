//! `flexns._flexns.EtcdStore`: a small etcd client for Python (the workspace's `etcd-lite`),
//! what `flexns.nixl` publishes and finds NIXL agent metadata with (`send_local_metadata`,
//! `fetch_remote_metadata`, `invalidate_local_metadata`). Every call releases the GIL; a
//! failure raises `TransferError` naming the endpoint and the operation.

use crate::TransferError;
use etcd_lite::{EtcdClient, PrefixView};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::time::Duration;

/// A connection to one etcd (the first of the endpoints given that answers), with prefix
/// watches kept current in the background.
#[pyclass(module = "flexns._flexns", name = "EtcdStore")]
pub struct EtcdStore {
    rt: tokio::runtime::Runtime,
    client: Mutex<EtcdClient>,
    views: Mutex<HashMap<Vec<u8>, PrefixView>>,
}

impl EtcdStore {
    fn run<T>(
        &self,
        py: Python<'_>,
        f: impl AsyncFnOnce(&mut EtcdClient) -> Result<T, etcd_lite::EtcdError> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        py.detach(|| {
            let mut c = self.client.lock().clone();
            self.rt.block_on(f(&mut c))
        })
        .map_err(|e| TransferError::new_err(e.to_string()))
    }
}

#[pymethods]
impl EtcdStore {
    /// Connects to the first of `endpoints` (comma-separated; `http://H:P`, `etcd://H:P` or
    /// `H:P`) that answers within 3 s; raises `ValueError` when none is given and
    /// `TransferError` (naming each endpoint's failure) when none answers.
    #[new]
    fn new(py: Python<'_>, endpoints: &str) -> PyResult<Self> {
        let list: Vec<&str> = endpoints.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        if list.is_empty() {
            return Err(PyValueError::new_err("endpoints: no etcd endpoint given"));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TransferError::new_err(format!("etcd client runtime: {e}")))?;
        let mut errors = Vec::new();
        for ep in list {
            match py.detach(|| rt.block_on(EtcdClient::connect(ep))) {
                Ok(client) => {
                    return Ok(EtcdStore {
                        rt,
                        client: Mutex::new(client),
                        views: Mutex::new(HashMap::new()),
                    })
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(TransferError::new_err(format!(
            "no etcd endpoint answered: {}",
            errors.join("; ")
        )))
    }

    /// The endpoint connected to.
    fn endpoint(&self) -> String {
        self.client.lock().endpoint().to_string()
    }

    /// Stores `value` under `key`.
    fn put(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        let (k, v) = (key.as_bytes().to_vec(), value.to_vec());
        self.run(py, async move |c: &mut EtcdClient| c.put(k, v).await)
    }

    /// The value under `key`, or None.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let k = key.as_bytes().to_vec();
        let v = self.run(py, async move |c: &mut EtcdClient| c.get(k).await)?;
        Ok(v.map(|v| PyBytes::new(py, &v)))
    }

    /// Deletes `key`; whether it existed.
    fn delete(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        let k = key.as_bytes().to_vec();
        self.run(py, async move |c: &mut EtcdClient| c.delete(k).await)
    }

    /// Starts following every key under `prefix` (a watch, on a thread of its own), once per
    /// prefix, and waits up to `timeout` seconds for its first complete read.
    #[pyo3(signature = (prefix, timeout = 5.0))]
    fn watch(&self, py: Python<'_>, prefix: &str, timeout: f64) -> PyResult<()> {
        let key = prefix.as_bytes().to_vec();
        if self.views.lock().contains_key(&key) {
            return Ok(());
        }
        let ep = self.endpoint();
        let mut view = PrefixView::start(&ep, &key).map_err(|e| TransferError::new_err(format!("etcd watch: {e}")))?;
        py.detach(|| view.wait_synced(Duration::from_secs_f64(timeout.max(0.0))))
            .map_err(|e| TransferError::new_err(format!("etcd {ep}: watching {prefix:?}: {e}")))?;
        self.views.lock().insert(key, view);
        Ok(())
    }

    /// What the watch of `prefix` last saw under `key`: (value, modification revision), or
    /// None if the key is absent. Raises `ValueError` if `prefix` is not watched.
    fn watched<'py>(&self, py: Python<'py>, prefix: &str, key: &str) -> PyResult<Option<(Bound<'py, PyBytes>, i64)>> {
        let views = self.views.lock();
        let view = views
            .get(prefix.as_bytes())
            .ok_or_else(|| PyValueError::new_err(format!("prefix {prefix:?} is not watched (call watch first)")))?;
        let snap = view.current();
        Ok(snap.entries.get(key.as_bytes()).map(|v| {
            let rev = snap.revisions.get(key.as_bytes()).copied().unwrap_or(0);
            (PyBytes::new(py, v), rev)
        }))
    }
}
