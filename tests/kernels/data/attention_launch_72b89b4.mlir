// attention seq=16 heads=9 kv_heads=3 head_dim=64 causal=True: herd 1x1, tile_q 16, tile_kv 16, 3x3x1 launch steps
%c3 = arith.constant 3 : index
%c1 = arith.constant 1 : index
air.launch @attention (%lx, %ly, %lz) in (%lsx=%c3, %lsy=%c3, %lsz=%c1) args(%q=%operand0, %kv=%operand1, %out=%operand2) : memref<16x576xbf16>, memref<2x16x192xbf16>, memref<16x576xbf16> {
  air.segment @attention_seg args(%lx_2=%lx, %ly_2=%ly, %lz_2=%lz, %q_2=%q, %kv_2=%kv, %out_2=%out) : index, index, index, memref<16x576xbf16>, memref<2x16x192xbf16>, memref<16x576xbf16> {
    %q_row0 = affine.apply affine_map<()[s0] -> (s0 * 16)>()[%lz_2]
    %q_col = affine.apply affine_map<()[s0, s1] -> (s0 * 192 + s1 * 64)>()[%lx_2, %ly_2]
    %kv_col = affine.apply affine_map<()[s0] -> (s0 * 64)>()[%lx_2]
    %q_l2 = memref.alloc() : memref<16x64xbf16, 1 : i32>
    %o_l2 = memref.alloc() : memref<16x64xbf16, 1 : i32>
    %c16 = arith.constant 16 : index
    %c64 = arith.constant 64 : index
    %c576 = arith.constant 576 : index
    %c1_2 = arith.constant 1 : index
    air.dma_memcpy_nd (%q_l2[] [] [], %q_2[%q_row0, %q_col] [%c16, %c64] [%c576, %c1_2]) : (memref<16x64xbf16, 1 : i32>, memref<16x576xbf16>)
    air.herd @attention_herd tile (%hx, %hy) in (%hsx=%c1_2, %hsy=%c1_2) args(%q_row0_2=%q_row0, %kv_col_2=%kv_col, %kv_3=%kv_2, %q_l2_2=%q_l2, %o_l2_2=%o_l2) : index, index, memref<2x16x192xbf16>, memref<16x64xbf16, 1 : i32>, memref<16x64xbf16, 1 : i32> attributes {link_with = "attention.o"} {
      %q_l1 = memref.alloc() : memref<1024xbf16, 2 : i32>
      %kv_l1 = memref.alloc() : memref<2x16x64xbf16, 2 : i32>
      %scores_l1 = memref.alloc() : memref<256xf32, 2 : i32>
      %probs_l1 = memref.alloc() : memref<256xbf16, 2 : i32>
      %row_max_l1 = memref.alloc() : memref<16xf32, 2 : i32>
      %row_sum_l1 = memref.alloc() : memref<16xf32, 2 : i32>
      %row_scale_l1 = memref.alloc() : memref<16xf32, 2 : i32>
      %acc_l1 = memref.alloc() : memref<1024xf32, 2 : i32>
      %out_l1 = memref.alloc() : memref<1024xbf16, 2 : i32>
      %local_row = affine.apply affine_map<()[s0] -> (s0 * 16)>()[%hx]
      %c0 = arith.constant 0 : index
      %c16_2 = arith.constant 16 : index
      %c64_2 = arith.constant 64 : index
      %c1_3 = arith.constant 1 : index
      air.dma_memcpy_nd (%q_l1[] [] [], %q_l2_2[%local_row, %c0] [%c16_2, %c64_2] [%c64_2, %c1_3]) : (memref<1024xbf16, 2 : i32>, memref<16x64xbf16, 1 : i32>)
      func.call @attn_init_f32(%row_max_l1, %row_sum_l1, %acc_l1) : (memref<16xf32, 2 : i32>, memref<16xf32, 2 : i32>, memref<1024xf32, 2 : i32>) -> ()
      %q_row = affine.apply affine_map<()[s0, s1] -> (s0 + s1)>()[%q_row0_2, %local_row]
      %q_start = arith.index_cast %q_row : index to i32
      scf.for %kv_trip = %c0 to %c1_3 step %c1_3 {
        %kv_4 = affine.apply affine_map<()[s0] -> (s0 * 16 + 0)>()[%kv_trip]
        %c2 = arith.constant 2 : index
        %c3072 = arith.constant 3072 : index
        %c192 = arith.constant 192 : index
        air.dma_memcpy_nd (%kv_l1[] [] [], %kv_3[%c0, %kv_4, %kv_col_2] [%c2, %c16_2, %c64_2] [%c3072, %c192, %c1_3]) : (memref<2x16x64xbf16, 2 : i32>, memref<2x16x192xbf16>)
        %k_start = arith.index_cast %kv_4 : index to i32
        func.call @attn_qk_tile_bf16(%q_l1, %kv_l1, %scores_l1, %q_start, %k_start) : (memref<1024xbf16, 2 : i32>, memref<2x16x64xbf16, 2 : i32>, memref<256xf32, 2 : i32>, i32, i32) -> ()
        func.call @attn_online_softmax_bf16(%scores_l1, %probs_l1, %row_max_l1, %row_sum_l1, %row_scale_l1) : (memref<256xf32, 2 : i32>, memref<256xbf16, 2 : i32>, memref<16xf32, 2 : i32>, memref<16xf32, 2 : i32>, memref<16xf32, 2 : i32>) -> ()
        func.call @attn_pv_accumulate_bf16(%probs_l1, %kv_l1, %row_scale_l1, %acc_l1) : (memref<256xbf16, 2 : i32>, memref<2x16x64xbf16, 2 : i32>, memref<16xf32, 2 : i32>, memref<1024xf32, 2 : i32>) -> ()
      }
      func.call @attn_finalize_bf16(%acc_l1, %row_sum_l1, %out_l1) : (memref<1024xf32, 2 : i32>, memref<16xf32, 2 : i32>, memref<1024xbf16, 2 : i32>) -> ()
      air.dma_memcpy_nd (%o_l2_2[%local_row, %c0] [%c16_2, %c64_2] [%c64_2, %c1_3], %out_l1[] [] []) : (memref<16x64xbf16, 1 : i32>, memref<1024xbf16, 2 : i32>)
      memref.dealloc %q_l1 : memref<1024xbf16, 2 : i32>
      memref.dealloc %kv_l1 : memref<2x16x64xbf16, 2 : i32>
      memref.dealloc %scores_l1 : memref<256xf32, 2 : i32>
      memref.dealloc %probs_l1 : memref<256xbf16, 2 : i32>
      memref.dealloc %row_max_l1 : memref<16xf32, 2 : i32>
      memref.dealloc %row_sum_l1 : memref<16xf32, 2 : i32>
      memref.dealloc %row_scale_l1 : memref<16xf32, 2 : i32>
      memref.dealloc %acc_l1 : memref<1024xf32, 2 : i32>
      memref.dealloc %out_l1 : memref<1024xbf16, 2 : i32>
    }
    air.dma_memcpy_nd (%out_2[%q_row0, %q_col] [%c16, %c64] [%c576, %c1_2], %o_l2[] [] []) : (memref<16x576xbf16>, memref<16x64xbf16, 1 : i32>)
    memref.dealloc %q_l2 : memref<16x64xbf16, 1 : i32>
    memref.dealloc %o_l2 : memref<16x64xbf16, 1 : i32>
  }
}