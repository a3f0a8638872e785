//! The standard gRPC introspection services every strata server exposes: health (`grpc.health.v1`) and
//! reflection, built from this crate's descriptor set, in both versions clients speak: `grpc.reflection.v1` and
//! `grpc.reflection.v1alpha` (grpcurl before 1.9 and many other tools know only v1alpha).

use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};
use tonic_reflection::server::v1alpha::{
    ServerReflection as ServerReflectionV1Alpha, ServerReflectionServer as ServerReflectionServerV1Alpha,
};

use crate::error::Result;
use crate::pb;

/// Full gRPC name of the public coordinator service, as health checks name it.
pub const COORDINATOR_SERVICE: &str = pb::coordinator_server::SERVICE_NAME;
/// Full gRPC name of the internal stage service, as health checks name it.
pub const STAGE_SERVICE: &str = pb::stage_server::SERVICE_NAME;

/// A health service and the reporter that sets its statuses. The overall status ("") starts as serving; named
/// services are unknown until set with [`set_serving`].
pub fn health_service() -> (HealthReporter, HealthServer<impl Health>) {
    tonic_health::server::health_reporter()
}

/// Marks `service` (e.g. [`STAGE_SERVICE`]) as serving or not serving.
pub async fn set_serving(reporter: &HealthReporter, service: &str, serving: bool) {
    let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
    reporter.set_service_status(service, status).await;
}

/// The reflection services, v1 and v1alpha, describing every `strata.v1` service and the health service. Serve
/// both.
pub fn reflection_services()
-> Result<(ServerReflectionServer<impl ServerReflection>, ServerReflectionServerV1Alpha<impl ServerReflectionV1Alpha>)>
{
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus as WireStatus;
    use tonic_health::pb::health_client::HealthClient;

    use super::*;

    #[test]
    fn descriptor_set_names_both_services() -> Result<(), prost::DecodeError> {
        let fds = prost_types_free_decode(pb::FILE_DESCRIPTOR_SET)?;
        assert!(fds.contains(&"strata.v1.Coordinator".to_owned()));
        assert!(fds.contains(&"strata.v1.Stage".to_owned()));
        assert_eq!(COORDINATOR_SERVICE, "strata.v1.Coordinator");
        assert_eq!(STAGE_SERVICE, "strata.v1.Stage");
        Ok(())
    }

    /// Service names in an encoded `FileDescriptorSet`, read with hand-written minimal messages.
    fn prost_types_free_decode(bytes: &[u8]) -> Result<Vec<String>, prost::DecodeError> {
        #[derive(Clone, PartialEq, Message)]
        struct Set {
            #[prost(message, repeated, tag = "1")]
            file: Vec<File>,
        }
        #[derive(Clone, PartialEq, Message)]
        struct File {
            #[prost(string, tag = "2")]
            package: String,
            #[prost(message, repeated, tag = "6")]
            service: Vec<Service>,
        }
        #[derive(Clone, PartialEq, Message)]
        struct Service {
            #[prost(string, tag = "1")]
            name: String,
        }
        let set = Set::decode(bytes)?;
        Ok(set.file.iter().flat_map(|f| f.service.iter().map(move |s| format!("{}.{}", f.package, s.name))).collect())
    }

    #[test]
    fn reflection_services_build() {
        assert!(reflection_services().is_ok());
    }

    #[tokio::test]
    async fn both_reflection_versions_list_every_service() -> Result<(), Box<dyn std::error::Error>> {
        use tonic_reflection::pb::{v1, v1alpha};
        let (reflection, reflection_v1alpha) = reflection_services()?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(reflection)
                .add_service(reflection_v1alpha)
                .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                }),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?.connect().await?;

        // The two versions' messages are the same in different modules: one body for both.
        macro_rules! list_services {
            ($v:ident) => {{
                let mut client = $v::server_reflection_client::ServerReflectionClient::new(channel.clone());
                let ask = $v::ServerReflectionRequest {
                    message_request: Some($v::server_reflection_request::MessageRequest::ListServices(String::new())),
                    ..Default::default()
                };
                let mut answers = client.server_reflection_info(tokio_stream::once(ask)).await?.into_inner();
                match answers.message().await?.and_then(|r| r.message_response) {
                    Some($v::server_reflection_response::MessageResponse::ListServicesResponse(l)) => {
                        l.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
                    }
                    other => return Err(format!("{}: {other:?}", stringify!($v)).into()),
                }
            }};
        }
        let v1_names = list_services!(v1);
        let v1alpha_names = list_services!(v1alpha);
        for name in [COORDINATOR_SERVICE, STAGE_SERVICE, "grpc.health.v1.Health"] {
            assert!(v1_names.iter().any(|n| n == name), "v1 lists {name}: {v1_names:?}");
            assert!(v1alpha_names.iter().any(|n| n == name), "v1alpha lists {name}: {v1alpha_names:?}");
        }
        let _ = stop.send(());
        server.await??;
        Ok(())
    }

    #[tokio::test]
    async fn served_health_reports_what_was_set() -> Result<(), Box<dyn std::error::Error>> {
        let (reporter, health) = health_service();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .add_service(reflection_services()?.0)
                .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                }),
        );

        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?.connect().await?;
        let mut client = HealthClient::new(channel);
        let check = |service: &str| tonic::Request::new(HealthCheckRequest { service: service.to_owned() });
        let unknown = client.check(check(STAGE_SERVICE)).await;
        assert_eq!(unknown.err().map(|s| s.code()), Some(tonic::Code::NotFound));

        set_serving(&reporter, STAGE_SERVICE, true).await;
        assert_eq!(client.check(check(STAGE_SERVICE)).await?.into_inner().status, WireStatus::Serving as i32);
        set_serving(&reporter, STAGE_SERVICE, false).await;
        assert_eq!(client.check(check(STAGE_SERVICE)).await?.into_inner().status, WireStatus::NotServing as i32);

        let _ = stop.send(());
        server.await??;
        Ok(())
    }
}
