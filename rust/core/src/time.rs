//! Timeouts as callers give them: seconds as a float, or none.

use crate::error::Error;
use std::time::Duration;

/// A timeout in seconds: `None` waits forever, negative counts as zero (as
/// `concurrent.futures` does), one too long for a `Duration` is
/// `Duration::MAX`; NaN is refused.
pub fn timeout_from_secs(timeout: Option<f64>) -> Result<Option<Duration>, Error> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(Error::InvalidArgument(
            "timeout must be a number of seconds or None, got nan".into(),
        )),
        Some(t) => Ok(Some(
            Duration::try_from_secs_f64(t.max(0.0)).unwrap_or(Duration::MAX),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_in_seconds_none_negative_huge_and_nan() {
        assert_eq!(timeout_from_secs(None), Ok(None));
        assert_eq!(
            timeout_from_secs(Some(1.5)),
            Ok(Some(Duration::from_millis(1500)))
        );
        assert_eq!(timeout_from_secs(Some(-3.0)), Ok(Some(Duration::ZERO)));
        assert_eq!(timeout_from_secs(Some(1e300)), Ok(Some(Duration::MAX)));
        assert_eq!(
            timeout_from_secs(Some(f64::INFINITY)),
            Ok(Some(Duration::MAX))
        );
        assert!(matches!(
            timeout_from_secs(Some(f64::NAN)),
            Err(Error::InvalidArgument(m)) if m.contains("nan")
        ));
    }
}
