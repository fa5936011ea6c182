//! A gRPC codec whose request is an `Arc<T>`: a retried request is encoded again from the
//! same shared message instead of deep-copying its tensors first. Responses decode with prost.

use std::marker::PhantomData;
use std::sync::Arc;

use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

pub struct SharedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SharedCodec<T, U> {
    fn default() -> Self {
        SharedCodec(PhantomData)
    }
}

impl<T, U> Codec for SharedCodec<T, U>
where
    T: Message + Send + Sync + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = Arc<T>;
    type Decode = U;
    type Encoder = SharedEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> SharedEncoder<T> {
        SharedEncoder(PhantomData)
    }

    fn decoder(&mut self) -> ProstDecoder<U> {
        ProstDecoder::default()
    }
}

pub struct SharedEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for SharedEncoder<T> {
    type Item = Arc<T>;
    type Error = Status;

    fn encode(&mut self, item: Arc<T>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // EncodeBuf grows as needed: encoding into it cannot run out of space.
        item.encode(buf).map_err(|e| Status::internal(format!("failed to encode the request: {e}")))
    }
}
