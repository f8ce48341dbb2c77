//! The one error shape every route answers with: `{"error": {"message", "type", "code"}}`.
//!
//! Bad input is a 4xx (an image too large for the device's memory included:
//! `image_too_large_for_device`; a body that stops arriving: 408 `body_read_timeout`);
//! refusals while sleeping (`engine_sleeping`), overloaded
//! (`overloaded`, with `Retry-After`), with a dead engine (`engine_dead`) or a lost device
//! (`device_lost`), and an item that does not fit in device memory next to other work
//! (`device_out_of_memory`, with `Retry-After`) are a 503; only faults inside iris are a 500
//! (a failed device step: `device_error`). axum's own rejections (body too large, unknown
//! route, wrong method) are mapped
//! to the same shape so a client never has to parse plain text.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::engine_api::EngineError;

/// `Retry-After` of a 503 `overloaded`, in seconds: queued work drains in about a step or two.
pub const OVERLOADED_RETRY_AFTER_S: u64 = 1;

/// An HTTP error response: status plus the JSON error object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message} ({code})")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, naming the field and the numbers.
    pub message: String,
    /// The error class: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `service_unavailable_error`, `upstream_error` (an EC consumer failed: 502, or 504 when it
    /// did not answer in time) or `internal_error`.
    pub kind: &'static str,
    /// A stable machine-readable code, e.g. `invalid_base64`.
    pub code: &'static str,
    /// Seconds a client should wait before retrying, sent as `Retry-After` (503 `overloaded`).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// A 400 for unusable client input.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// An error with an explicit status and class.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code,
            retry_after_s: None,
        }
    }

    /// A 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            "missing or invalid API key: send `Authorization: Bearer <key>`",
        )
    }

    /// A 408 `body_read_timeout`: an admitted request did not send its body within `limit`
    /// (`--body-read-timeout`). The response closes the connection, as RFC 9110 asks of a 408.
    pub fn body_read_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_read_timeout",
            format!(
                "the request body did not arrive within the body-read timeout of {} s (--body-read-timeout)",
                limit.as_secs_f64()
            ),
        )
    }

    /// A 503: the engine cannot serve now (`code` says why).
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable_error",
            code,
            message,
        )
    }

    /// A 500 for a fault inside iris.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal_error",
            message,
        )
    }

    /// The JSON body of this error.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": { "message": self.message, "type": self.kind, "code": self.code }
        })
    }
}

impl From<EngineError> for ApiError {
    fn from(err: EngineError) -> Self {
        match err {
            EngineError::BadInput { message, code } => Self::bad_request(code, message),
            EngineError::Sleeping => Self::unavailable("engine_sleeping", err.to_string()),
            EngineError::Overloaded => Self {
                retry_after_s: Some(OVERLOADED_RETRY_AFTER_S),
                ..Self::unavailable("overloaded", err.to_string())
            },
            EngineError::Dead(_) => Self::unavailable("engine_dead", err.to_string()),
            EngineError::DeviceLost(_) => Self::unavailable("device_lost", err.to_string()),
            EngineError::TooLargeForDevice { message, .. } => {
                Self::bad_request("image_too_large_for_device", message)
            }
            EngineError::OutOfMemory {
                message,
                retry_after_s,
            } => Self {
                retry_after_s: Some(retry_after_s),
                ..Self::unavailable("device_out_of_memory", message)
            },
            EngineError::Unsupported { message, code } => Self::new(
                StatusCode::NOT_IMPLEMENTED,
                "not_implemented_error",
                code,
                message,
            ),
            EngineError::Device(_) => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "device_error",
                err.to_string(),
            ),
            // Internal, and any kind a later engine adds: a fault, never the client's.
            _ => Self::internal(err.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of the body may still come: the connection cannot be reused.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_and_device_faults_map_to_their_status_code_and_retry_after() {
        let too_large = ApiError::from(EngineError::TooLargeForDevice {
            message: "image 0 needs 9 bytes, at most 4".to_owned(),
            needed_bytes: 9,
            available_bytes: 4,
        });
        assert_eq!(
            (too_large.status, too_large.code, too_large.retry_after_s),
            (StatusCode::BAD_REQUEST, "image_too_large_for_device", None)
        );
        let later = ApiError::from(EngineError::OutOfMemory {
            message: "retry".to_owned(),
            retry_after_s: 2,
        });
        assert_eq!(
            (later.status, later.code, later.retry_after_s),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "device_out_of_memory",
                Some(2)
            )
        );
        let response = later.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        let device = ApiError::from(EngineError::Device("gemm failed".to_owned()));
        assert_eq!(
            (device.status, device.code),
            (StatusCode::INTERNAL_SERVER_ERROR, "device_error")
        );
        assert!(device.message.contains("gemm failed"), "{}", device.message);
    }
}
