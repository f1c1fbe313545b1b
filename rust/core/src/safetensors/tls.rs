//! TLS for HTTPS sources: rustls, with one difference from ureq's own
//! connector. A certificate the user trusts by name in `$SSL_CERT_FILE` is
//! accepted as the server's own certificate even when it says it is a CA:
//! `openssl req -x509` makes such certificates (CA:TRUE), and OpenSSL, hence
//! Python's `ssl` and curl, accept one that is trusted and matches the host,
//! where webpki refuses it (`CaUsedAsEndEntity`). Every other check is
//! webpki's own, unchanged.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_name, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{CertificateError, ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use std::io::{Read, Write};
use std::sync::Arc;
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, Either, LazyBuffers, NextTimeout, Transport,
    TransportAdapter,
};

/// The roots to trust: Mozilla's, or the certificates of `$SSL_CERT_FILE`
/// (then also accepted as a server's own certificate, see the module doc).
#[derive(Debug, Clone)]
pub enum Roots {
    /// Mozilla's roots (webpki-roots).
    Mozilla,
    /// The user's certificates, DER.
    User(Vec<CertificateDer<'static>>),
}

/// Wraps a connection in TLS for `https` URLs; other URLs pass through.
#[derive(Debug)]
pub struct TlsConnector {
    config: Arc<ClientConfig>,
}

impl TlsConnector {
    /// A connector trusting `roots`; fails when the crypto provider refuses
    /// the protocol versions (it does not with ring's defaults).
    pub fn new(roots: Roots) -> Result<TlsConnector, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (store, trusted) = match roots {
            Roots::Mozilla => (
                RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                },
                Vec::new(),
            ),
            Roots::User(certs) => {
                let mut store = RootCertStore::empty();
                store.add_parsable_certificates(certs.iter().cloned());
                (store, certs)
            }
        };
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(store), provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let verifier = Arc::new(TrustedAsIs {
            webpki,
            trusted,
            provider: provider.clone(),
        });
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous() // a verifier that only adds the one OpenSSL rule above
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(TlsConnector {
            config: Arc::new(config),
        })
    }
}

#[derive(Debug)]
struct TrustedAsIs {
    webpki: Arc<WebPkiServerVerifier>,
    /// The user's own certificates (empty with Mozilla's roots).
    trusted: Vec<CertificateDer<'static>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for TrustedAsIs {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            // webpki's errors without a variant of their own (a CA used as the
            // server's certificate among them): expired, unknown issuer, wrong
            // name and bad signatures have theirs and stand.
            Err(rustls::Error::InvalidCertificate(CertificateError::Other(_)))
                if self
                    .trusted
                    .iter()
                    .any(|c| c.as_ref() == end_entity.as_ref()) =>
            {
                verify_server_name(&ParsedCertificate::try_from(end_entity)?, server_name)?;
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

impl<In: Transport> Connector<In> for TlsConnector {
    type Out = Either<In, TlsTransport>;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<In>,
    ) -> Result<Option<Self::Out>, ureq::Error> {
        let Some(transport) = chained else {
            return Ok(None); // no connection to wrap: the chain has none either
        };
        if !details.needs_tls() || transport.is_tls() {
            return Ok(Some(Either::A(transport)));
        }
        let host = details
            .uri
            .authority()
            .map(|a| a.host().trim_start_matches('[').trim_end_matches(']'))
            .unwrap_or_default();
        let name = ServerName::try_from(host)
            .map_err(|_| ureq::Error::Tls("not a DNS name or IP address for TLS"))?
            .to_owned();
        let mut conn = ClientConnection::new(self.config.clone(), name)?;
        let mut sock = TransportAdapter::new(transport.boxed(), details.current_time.clone());
        sock.set_timeout(details.timeout);
        conn.complete_io(&mut sock)?;
        let buffers = LazyBuffers::new(
            details.config.input_buffer_size(),
            details.config.output_buffer_size(),
        );
        Ok(Some(Either::B(TlsTransport {
            buffers,
            stream: StreamOwned { conn, sock },
        })))
    }
}

/// A TLS connection over the chained transport.
pub struct TlsTransport {
    buffers: LazyBuffers,
    stream: StreamOwned<ClientConnection, TransportAdapter>,
}

impl std::fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsTransport")
    }
}

impl Transport for TlsTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        self.stream.get_mut().set_timeout(timeout);
        let output = &self.buffers.output()[..amount];
        self.stream.write_all(output)?;
        Ok(())
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.stream.get_mut().set_timeout(timeout);
        let input = self.buffers.input_append_buf();
        let amount = self.stream.read(input)?;
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        self.stream.get_mut().get_mut().is_open()
    }

    fn is_tls(&self) -> bool {
        true
    }
}
