//! The actor's link to the stages of its plan, made off the actor's task so that no stage I/O ever blocks the
//! scheduler loop: every stage is asked for its status at once (each within the probe timeout), the stages that
//! do not answer are named as suspects for the control loop to plan around, a stage already on another plan
//! epoch or leadership term means the plan is changing (wait for the next one), and the `Forward` stream to stage
//! 0 (with the last stage's `Answers` stream beside it) is opened only when every stage is fine.

use std::time::Duration;

use strata_proto::{Keepalive, NodeId, ServiceError, Tls, pb};

use super::kv_budget::KvBudget;
use crate::metrics::StageMemory;
use crate::stage_client::{self, ForwardStream, TracedStageClient};
use strata_membership::Plan;

/// A stage the pipeline could not reach: the control loop leaves it out of the next plan for a while.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suspect {
    /// The stage's node.
    pub node_id: NodeId,
    /// The plan epoch it failed under.
    pub epoch: u64,
    /// What failed, for the logs.
    pub reason: String,
}

/// An open link: a client of every stage (for releases), the `Forward` stream to stage 0, and the stages' KV
/// budget.
pub(super) struct Connected {
    pub(super) clients: Vec<TracedStageClient>,
    pub(super) stream: ForwardStream,
    pub(super) budget: KvBudget,
    /// What each stage reports of its memory, in pipeline order.
    pub(super) memory: Vec<StageMemory>,
}

/// Why a link could not be made, and the stages to blame (none when the plan is just changing).
#[derive(Debug)]
pub(super) struct Failed {
    pub(super) error: ServiceError,
    pub(super) suspects: Vec<Suspect>,
    /// A stage follows a newer leadership term than the plan's: another coordinator leads now.
    pub(super) deposed: bool,
}

impl Failed {
    fn new(error: ServiceError, suspects: Vec<Suspect>) -> Self {
        Failed { error, suspects, deposed: false }
    }
}

/// How connections to the stages are made.
#[derive(Debug, Clone)]
pub(super) struct Dialer {
    pub(super) tls: Option<Tls>,
    pub(super) keepalive: Keepalive,
    /// How long one stage may take to answer `Status`.
    pub(super) probe_timeout: Duration,
}

impl Dialer {
    /// Probes every stage of `plan` and opens the `Forward` stream to its stage 0.
    pub(super) async fn connect(&self, plan: &Plan) -> Result<Connected, Failed> {
        if plan.stages.is_empty() {
            let error = ServiceError::unavailable(
                "no plan is being served (this coordinator is not the leader, or no stages are ready)",
            );
            return Err(Failed::new(error, Vec::new()));
        }
        let probes = plan.stages.iter().map(|stage| async move {
            let status = self.status(&stage.address).await;
            (stage, status)
        });
        let results = futures_util::future::join_all(probes).await;
        let mut statuses = Vec::with_capacity(results.len());
        let mut suspects = Vec::new();
        let mut first_error = None;
        for (stage, result) in results {
            match result {
                Ok(found) => statuses.push((stage, found)),
                Err(error) => {
                    suspects.push(Suspect {
                        node_id: stage.node_id.clone(),
                        epoch: plan.epoch.0,
                        reason: error.to_string(),
                    });
                    first_error.get_or_insert(error);
                }
            }
        }
        if let Some(error) = first_error {
            return Err(Failed::new(error, suspects));
        }
        // A stage that saw a higher term obeys a newer leader: this coordinator is deposed, whatever else differs.
        if let Some((stage, (_, status))) = statuses.iter().find(|(_, (_, s))| s.term > plan.term) {
            let error = ServiceError::unavailable(format!(
                "another coordinator leads now (stage {} follows leadership term {}, newer than this one's {}); \
                 retry on the leader",
                stage.node_id, status.term, plan.term
            ));
            return Err(Failed { error, suspects: Vec::new(), deposed: true });
        }
        // A stage on another epoch has moved on (or not yet) to a plan this pipeline does not serve: not a fault,
        // wait for the plan to settle.
        if let Some((stage, (_, status))) =
            statuses.iter().find(|(_, (_, s))| s.plan_epoch != 0 && s.plan_epoch != plan.epoch.0)
        {
            let error = ServiceError::failed_precondition(format!(
                "stage {} serves plan epoch {}, not {}: the plan is changing",
                stage.node_id, status.plan_epoch, plan.epoch
            ));
            return Err(Failed::new(error, Vec::new()));
        }
        let (clients, statuses): (Vec<TracedStageClient>, Vec<pb::StageStatus>) =
            statuses.into_iter().map(|(_, found)| found).unzip();
        let budget = KvBudget::from_statuses(&statuses).map_err(|error| Failed::new(error, Vec::new()))?;
        let memory = statuses
            .iter()
            .map(|s| StageMemory { kv_tokens: s.kv_capacity_tokens(), offloaded_layers: u64::from(s.offloaded_layers) })
            .collect();
        let stage0 = &plan.stages[0];
        let mut client = clients[0].clone();
        let mut stream = stage_client::open_forward(&mut client).await.map_err(|error| {
            let suspect = Suspect { node_id: stage0.node_id.clone(), epoch: plan.epoch.0, reason: error.to_string() };
            Failed::new(error, vec![suspect])
        })?;
        // The last stage's answers straight here, past the stages before it; without the stream (a failure to
        // open it is only logged) they come relayed, as they did before it existed.
        if let [_, .., last] = clients.as_slice() {
            match stage_client::open_answers(&mut last.clone(), plan.term).await {
                Ok(answers) => stream.answers = Some(answers),
                Err(error) => {
                    tracing::warn!(%error, "cannot open the last stage's Answers stream; answers come relayed")
                }
            }
        }
        Ok(Connected { clients, stream, budget, memory })
    }

    /// Connects to the stage at `address` and asks for its status, within the probe timeout.
    async fn status(&self, address: &str) -> Result<(TracedStageClient, pb::StageStatus), ServiceError> {
        let ask = async {
            let mut client = stage_client::connect(address, self.tls.as_ref(), self.keepalive).await?;
            let status = client.status(pb::StageStatusRequest {}).await.map_err(ServiceError::from)?;
            Ok::<_, ServiceError>((client, status.into_inner()))
        };
        match tokio::time::timeout(self.probe_timeout, ask).await {
            Ok(result) => result.map_err(|e| ServiceError::unavailable(format!("stage {address}: {}", e.message))),
            Err(_) => Err(ServiceError::unavailable(format!(
                "stage {address} did not answer Status within {:?}",
                self.probe_timeout
            ))),
        }
    }
}
